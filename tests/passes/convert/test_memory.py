"""``qc.convert``'s memory: the conversion shares the source graph's float weights instead
of copying them, holds each weight's integers once at one byte per element (8-bit grids),
and the result owns its tensors (nothing shared with the source afterwards)."""

from __future__ import annotations

import torch
from torch import nn

import qcompile as qc
from qcompile.api import _sharing_copy
from qcompile.passes.convert.common import grid_dtype, integers
from qcompile.runtime.calibration import model_weights
from qcompile.runtime.fake_quant import FakeQuantize


def calibrated() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    gm = qc.qcompile(m, "int8-static", example_inputs=(torch.randn(2, 16),))
    return qc.calibrate(gm, [(torch.randn(8, 16),)], progress=False)


def test_the_conversion_copy_shares_float_weights_and_copies_quantizers():
    gm = calibrated()
    weights = model_weights(gm)
    out = _sharing_copy(gm, weights)
    copied = dict(out.named_parameters())
    assert weights and all(copied[n] is p for n, p in weights.items())  # no float copy
    for name, fq in qc.quantizers(gm).items():  # freeze / lowering change these: copies
        assert out.get_submodule(name) is not fq
        assert out.get_submodule(name).scale.data_ptr() != fq.scale.data_ptr()


def test_integers_take_one_byte_per_weight_element_on_8_bit_grids():
    assert grid_dtype(-128, 127) == torch.int8 and grid_dtype(0, 255) == torch.uint8
    assert grid_dtype(-8, 7) == torch.int8 and grid_dtype(-32768, 32767) == torch.int16
    fq = FakeQuantize("int8", symmetric=True)
    fq.scale.fill_(0.1)
    t = integers(fq, torch.randn(64, 32))
    assert t.q.dtype == torch.int8 and t.q.shape == (64, 32)


def test_the_result_owns_its_tensors_and_the_source_is_untouched():
    gm = calibrated()
    before = {n: p.detach().clone() for n, p in gm.named_parameters()}
    int8 = qc.convert(gm)
    ptrs = {p.untyped_storage().data_ptr() for p in gm.parameters()}
    for name, t in [*int8.named_parameters(), *int8.named_buffers()]:
        assert t.untyped_storage().data_ptr() not in ptrs, name
    for name, p in gm.named_parameters():
        assert torch.equal(p, before[name]), name


def test_int_weights_are_parameters_without_gradient():
    gm = qc.qcompile(nn.Sequential(nn.Linear(8, 8)), "w8-weight-only",
                     example_inputs=(torch.randn(2, 8),))
    int8 = qc.convert(gm)
    ints = {n: p for n, p in int8.named_parameters() if not p.dtype.is_floating_point}
    assert sorted(ints) == ["0.weight.packed", "0.weight.zero_point"]
    assert not any(p.requires_grad for p in ints.values())
    assert sorted(int8.state_dict()) == ["0.bias", "0.weight.packed", "0.weight.scale",
                                         "0.weight.zero_point"]
