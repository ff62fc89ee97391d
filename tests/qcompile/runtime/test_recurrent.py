"""``qcompile.runtime.recurrent``: the recurrent functions compute what the stock modules
compute; in dynamic mode, what torch's dynamic quantized recurrent kernels compute; and
``DynamicRecurrent`` (what ``qc.convert`` makes) matches them."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from qcompile.errors import QCompileError
from qcompile.passes.convert.common import integers, qint8
from qcompile.runtime import recurrent as R
from qcompile.runtime.engines import use_engine
from qcompile.runtime.fake_quant import FakeQuantize

pytestmark = pytest.mark.usefixtures("one_thread")


SEQUENCES = {nn.LSTM: R.lstm, nn.GRU: R.gru, nn.RNN: R.rnn}
CELLS = {nn.LSTMCell: R.lstm_cell, nn.GRUCell: R.gru_cell, nn.RNNCell: R.rnn_cell}
ENGINES = [e for e in ("x86", "qnnpack") if e in torch.backends.quantized.supported_engines]


def _first(out):
    """The output tensor of a sequence module / an LSTM cell's h."""
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize(("cls", "kw", "shape"), [
    (nn.LSTM, dict(num_layers=2, bidirectional=True), (5, 2, 3)),
    (nn.LSTM, dict(proj_size=2, batch_first=True), (2, 5, 3)),
    (nn.LSTM, dict(bias=False), (5, 3)),  # unbatched
    (nn.GRU, dict(num_layers=2, batch_first=True), (2, 5, 3)),
    (nn.RNN, dict(nonlinearity="relu", bidirectional=True), (5, 2, 3)),
])
def test_float_sequence_is_the_stock_module(cls, kw, shape) -> None:
    torch.manual_seed(0)
    m = cls(3, 4, **kw)
    x = torch.randn(*shape)
    fn = SEQUENCES[cls]
    config = {k: v for k, v in kw.items() if k != "nonlinearity"}
    if cls is nn.RNN:
        config["nonlinearity"] = m.nonlinearity
    out, hidden = fn(x, None, m._flat_weights, hidden_size=4, **config)
    ref, ref_hidden = m(x)
    assert torch.equal(out, ref)
    for a, b in zip(torch.utils._pytree.tree_leaves(hidden),
                    torch.utils._pytree.tree_leaves(ref_hidden), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", list(CELLS))
@pytest.mark.parametrize("batched", [True, False])
def test_float_cell_is_the_stock_module(cls, batched: bool) -> None:
    torch.manual_seed(0)
    m = cls(3, 4)
    x = torch.randn(2, 3) if batched else torch.randn(3)
    h = torch.randn(2, 4) if batched else torch.randn(4)
    hx = (h, h) if cls is nn.LSTMCell else h
    for state in (None, hx):
        got = CELLS[cls](x, state, list(m.parameters()), hidden_size=4)
        ref = m(x, state)
        assert torch.equal(_first(got), _first(ref))


def _quantized(m: nn.Module, *, reduce_range: bool = True):
    """(fake-quantized weights in kernel order, per-layer qint8 weights, input and hidden
    dynamic quantizers) of a stock module, int8 per-channel weights."""
    ws, layers, q = [], [], {}
    for name in R.weight_names(m):
        p = getattr(m, name)
        if name.startswith("weight"):
            fq = FakeQuantize("int8", granularity="per_channel", axis=0, channels=p.shape[0])
            fq.observe_tensor(p)
            q[name] = qint8(integers(fq, p))
            ws.append(fq(p).detach())
        else:
            ws.append(p.detach())
    names = R.weight_names(m)
    for k in range(0, len(names), 4):
        w_ih, w_hh, b_ih, b_hh = names[k:k + 4]
        layers.append((q[w_ih], q[w_hh], getattr(m, b_ih).detach(), getattr(m, b_hh).detach()))
    quant = [FakeQuantize("uint8", symmetric=False, dynamic=True, reduce_range=reduce_range)
             for _ in range(2)]
    return ws, layers, quant


def _engine_for(reduce_range: bool) -> str:
    """x86 computes 7-bit activations exactly on every x86 CPU, qnnpack 8-bit ones."""
    return "x86" if reduce_range else "qnnpack"


@pytest.mark.parametrize("reduce_range", [True, False])
@pytest.mark.parametrize("cls", list(CELLS))
def test_converted_cell_matches_the_dynamic_fake_quant_call(cls, reduce_range: bool) -> None:
    """One cell call: the same integers on both sides (weights and per-call activation
    qparams), so the two differ by float32 rounding of the sums only."""
    engine = _engine_for(reduce_range)
    if engine not in ENGINES:
        pytest.skip(f"no {engine} engine")
    torch.manual_seed(1)
    m = cls(16, 32)
    x, h = torch.randn(4, 16), torch.randn(4, 32).tanh()
    hx = (h, torch.randn(4, 32)) if cls is nn.LSTMCell else h
    with use_engine(engine), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ws, layers, (qi, qh) = _quantized(m, reduce_range=reduce_range)
        layer = R.DynamicRecurrent(R.cell_kind(m), layers, cell=True, reduce_range=reduce_range)
    # torch's own dynamic cells where they compute it (they always use 7 bits)
    assert (layer.kernel is not None) == reduce_range
    with torch.no_grad():
        want = CELLS[cls](x, hx, ws, hidden_size=32, input_quant=qi, hidden_quant=qh,
                          **({"nonlinearity": "tanh"} if cls is nn.RNNCell else {}))
        got = layer(x, hx)
        ref = m(x, hx)
    for a, b in zip(torch.utils._pytree.tree_leaves(got),
                    torch.utils._pytree.tree_leaves(want), strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    # and the dynamic quantization is a real one: 7 / 8-bit error, not float
    err = float((_first(want) - _first(ref)).norm() / _first(ref).norm())
    assert 1e-4 < err < 0.05


def _hidden_step(out: torch.Tensor) -> float:
    """One step of a 7-bit hidden quantizer over ``out``'s range (the per-step hidden
    ranges lie inside it, so their steps are no larger)."""
    return float(out.max().clamp(min=0) - out.min().clamp(max=0)) / 127


@pytest.mark.parametrize(("cls", "kw", "kernel"), [
    (nn.LSTM, dict(num_layers=2, bidirectional=True), "LSTM"),
    (nn.GRU, dict(batch_first=True), "GRU"),
    (nn.RNN, dict(num_layers=2), None),
])
def test_converted_sequence_matches_the_dynamic_fake_quant(cls, kw, kernel) -> None:
    """Products on the same integers; a hidden value within float32 rounding of a
    rounding boundary may quantize one step apart and later steps carry that: the outputs
    agree within 2 hidden steps (measured: float32 rounding, 1e-7, for almost all layers)."""
    torch.manual_seed(2)
    m = cls(16, 32, **kw)
    x = torch.randn(6, 4, 16)
    with use_engine("x86"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ws, layers, (qi, qh) = _quantized(m)
        layer = R.DynamicRecurrent(R.cell_kind(m), layers, **kw)
    assert (type(layer.kernel).__name__ if layer.kernel is not None else None) == kernel
    with torch.no_grad():
        want, want_h = SEQUENCES[cls](x, None, ws, hidden_size=32, input_quant=qi,
                                      hidden_quant=qh, **kw)
        got, got_h = layer(x)
    assert float((got - want).abs().max()) <= 2 * _hidden_step(want)
    for a, b in zip(torch.utils._pytree.tree_leaves(got_h),
                    torch.utils._pytree.tree_leaves(want_h), strict=True):
        assert float((a - b).abs().max()) <= 2 * _hidden_step(b)
    # unbatched input and a given hidden state go through the same way
    h0 = want_h if cls is not nn.LSTM else tuple(want_h)
    with torch.no_grad():
        one = layer(x[:, 0] if not kw.get("batch_first") else x[0],
                    torch.utils._pytree.tree_map(lambda t: t[:, 0], h0))[0]
        ref = SEQUENCES[cls](x[:, 0] if not kw.get("batch_first") else x[0],
                             torch.utils._pytree.tree_map(lambda t: t[:, 0], h0), ws,
                             hidden_size=32, input_quant=qi, hidden_quant=qh, **kw)[0]
    assert one.shape == ref.shape and float((one - ref).abs().max()) <= 2 * _hidden_step(ref)


def test_dynamic_recurrence_is_aten_s_order_of_operations() -> None:
    """With the quantizers switched off, the Python recurrence (dynamic mode's) computes
    the stock module's result up to float32 rounding."""
    torch.manual_seed(3)
    off = FakeQuantize("uint8", symmetric=False, dynamic=True)
    off.enabled = False
    for cls, fn in SEQUENCES.items():
        m = cls(5, 6, num_layers=2, bidirectional=True)
        x = torch.randn(4, 2, 5)
        with torch.no_grad():
            out, _ = fn(x, None, m._flat_weights, hidden_size=6, num_layers=2,
                        bidirectional=True, input_quant=off, hidden_quant=off)
            assert torch.allclose(out, m(x)[0], atol=1e-6), cls


def test_dynamic_fake_quant_trains_straight_through() -> None:
    torch.manual_seed(4)
    m = nn.GRU(3, 4)
    fq = FakeQuantize("int8", granularity="per_channel", axis=0, channels=12)
    qi, qh = (FakeQuantize("uint8", symmetric=False, dynamic=True) for _ in range(2))
    ws = [fq(p) if p.dim() == 2 else p for p in m._flat_weights]
    out, _ = R.gru(torch.randn(5, 2, 3), None, ws, hidden_size=4, input_quant=qi,
                   hidden_quant=qh)
    out.sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in m.parameters())


def test_dropout_follows_the_module_s_training_flag() -> None:
    torch.manual_seed(5)
    m = nn.LSTM(3, 4, num_layers=2, dropout=0.5)
    x = torch.randn(6, 2, 3)

    def run():
        return R.lstm(x, None, m._flat_weights, hidden_size=4, num_layers=2, dropout=0.5,
                      module=m)[0]

    m.train()
    assert not torch.equal(run(), run())
    m.eval()
    assert torch.equal(run(), m(x)[0])


def test_packed_sequence_is_refused_naming_the_layer() -> None:
    m = nn.LSTM(3, 4)
    packed = pack_padded_sequence(torch.randn(5, 2, 3), torch.tensor([5, 3]))
    with pytest.raises(QCompileError, match=r"encoder\.rnn: a PackedSequence"):
        R.lstm(packed, None, m._flat_weights, hidden_size=4, name="encoder.rnn")


def test_dynamic_proj_size_is_refused() -> None:
    m = nn.LSTM(3, 4, proj_size=2)
    q = FakeQuantize("uint8", symmetric=False, dynamic=True)
    with pytest.raises(QCompileError, match="proj_size"):
        R.lstm(torch.randn(5, 2, 3), None, m._flat_weights, hidden_size=4, proj_size=2,
               input_quant=q, hidden_quant=q, name="lstm")


@pytest.mark.parametrize("kind", ["lstm", "rnn_tanh"])
def test_converted_layer_saves_and_loads(kind: str) -> None:
    """torch.save of the whole module, and load_state_dict into another one (packed
    weights, torch's module or not), give the same outputs."""
    torch.manual_seed(6)
    m = nn.LSTM(4, 8) if kind == "lstm" else nn.RNN(4, 8)
    other = nn.LSTM(4, 8) if kind == "lstm" else nn.RNN(4, 8)
    x = torch.randn(3, 2, 4)
    with use_engine("x86"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = R.DynamicRecurrent(kind, _quantized(m)[1])
        fresh = R.DynamicRecurrent(kind, _quantized(other)[1])
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    fresh.load_state_dict(layer.state_dict())
    with torch.no_grad():
        want = layer(x)[0]
        assert torch.equal(back(x)[0], want) and torch.equal(fresh(x)[0], want)
    assert "7-bit" in repr(layer) and "\n" not in repr(layer)
