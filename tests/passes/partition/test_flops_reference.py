"""``pipeline.balance: flops`` prices convolutions by their definition.

The reference is computed here from the layer's hyper-parameters and the input shape, not
from the graph: a convolution's output size per spatial dim is
``floor((L + 2 p - d (k - 1) - 1) / s) + 1`` and each output element is a dot product over
``Cin/groups x prod(k)`` inputs, so forward flops (a multiply-add counting 2, bias ignored,
the partition pass's documented convention) are
``2 * N * Cout * prod(out) * Cin/groups * prod(k)``. A transposed convolution scatters each
of the ``N * Cin * prod(in)`` input elements into ``Cout/groups * prod(k)`` outputs. A
stage's cost is forward + backward: 3 x the forward flops.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import qcompile as qc

# (layer, input shape)
CONVS = {
    "conv1d_stride_pad": (lambda: nn.Conv1d(3, 5, 4, stride=2, padding=3), (2, 3, 17)),
    "conv2d_plain": (lambda: nn.Conv2d(3, 4, 3), (2, 3, 8, 8)),
    "conv2d_stride_pad_groups": (lambda: nn.Conv2d(4, 6, (3, 2), stride=(2, 1),
                                                   padding=(1, 2), groups=2), (2, 4, 9, 7)),
    "conv2d_dilation_depthwise": (lambda: nn.Conv2d(6, 6, 3, dilation=2, padding=1,
                                                    groups=6), (1, 6, 11, 10)),
    "conv3d_all": (lambda: nn.Conv3d(4, 8, (2, 3, 3), stride=(1, 2, 2), padding=(1, 0, 1),
                                     dilation=(2, 1, 1), groups=4), (2, 4, 5, 7, 6)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), (2, 3, 6)),
    "conv_transpose2d_groups": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1,
                                                           groups=2), (2, 4, 5, 5)),
}


def reference_forward_flops(layer: nn.Module, shape: tuple[int, ...]) -> int:
    """From the definition (see the module docstring), never from the graph."""
    n, c_in, *spatial = shape
    k = layer.kernel_size
    if isinstance(layer, nn.modules.conv._ConvTransposeNd):
        return 2 * n * c_in * math.prod(spatial) * (layer.out_channels // layer.groups) \
            * math.prod(k)
    out = [(size + 2 * p - d * (kk - 1) - 1) // s + 1
           for size, p, d, kk, s in zip(spatial, layer.padding, layer.dilation, k,
                                        layer.stride)]
    return 2 * n * layer.out_channels * math.prod(out) * (c_in // layer.groups) * math.prod(k)


def test_reference_formula_matches_the_output_shape_torch_computes() -> None:
    # the hand-written output size is the one torch produces (guards the reference itself)
    for make, shape in CONVS.values():
        layer = make()
        if isinstance(layer, nn.modules.conv._ConvTransposeNd):
            continue
        y = layer(torch.zeros(shape))
        n, _, *spatial = shape
        dims = [(size + 2 * p - d * (kk - 1) - 1) // s + 1
                for size, p, d, kk, s in zip(spatial, layer.padding, layer.dilation,
                                             layer.kernel_size, layer.stride)]
        assert list(y.shape) == [n, layer.out_channels, *dims]


# every case through the symbolic front end (modules), two through export (functional
# aten calls, a separate code path in the cost model); export is slow
CASES = [(c, "symbolic") for c in CONVS] + [
    ("conv2d_stride_pad_groups", "export"), ("conv_transpose2d_groups", "export")]


@pytest.mark.parametrize(("case", "method"), CASES, ids=[f"{c}-{m}" for c, m in CASES])
def test_conv_flops_cost(case: str, method: str) -> None:
    make, shape = CONVS[case]
    torch.manual_seed(0)
    layer = make()
    model = nn.Sequential(layer)
    spec = {"pipeline": {"stages": 1, "balance": "flops"}, "trace": {"method": method}}
    gm = qc.qcompile(model, spec, example_inputs=(torch.randn(shape),))
    (stage,) = qc.report(gm).stages
    assert stage.cost == 3.0 * reference_forward_flops(layer, shape)


def test_flops_balance_splits_convolutions_by_their_cost() -> None:
    """Three convs of equal weights whose flops differ by stride alone: the split and the
    stage costs follow the flops (a model counting weights would see three equal costs)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1),
                          nn.Conv2d(4, 4, 3, stride=4, padding=1))
    x = torch.randn(1, 4, 16, 16)
    gm = qc.qcompile(model, {"pipeline": {"stages": 2, "balance": "flops"}},
                     example_inputs=(x,))
    stages = qc.report(gm).stages
    assert [s.modules for s in stages] == [["0"], ["1", "2"]]
    full = reference_forward_flops(model[0], (1, 4, 16, 16))
    small = reference_forward_flops(model[2], (1, 4, 16, 16))
    assert [s.cost for s in stages] == [3.0 * full, 3.0 * (full + small)]
