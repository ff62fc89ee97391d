"""Shape propagation on symbolic graphs (``qcompile.passes.trace.shape_prop``): meta tensors
against torch's own ``ShapeProp``, the fallbacks to a real run, state left alone,
``copy_model`` (``qcompile.passes.trace.model_copy``) against ``copy.deepcopy``, and the
pipeline recompiling only changed graphs.

The reference is ``torch.fx.passes.shape_prop.ShapeProp`` on a ``torch.fx.symbolic_trace``
of an eval-mode copy of the model under ``no_grad``, the setting ``trace`` has always
recorded shapes in (so computed values have ``requires_grad=False``; placeholders and
parameters keep theirs). Nodes are matched by name; strides are not compared (shape_prop
documents that meta kernels may lay some outputs out differently).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.nn.utils import parametrizations, parametrize

import qcompile as qc
from qcompile.graph.context import Context
from qcompile.graph.pipeline import Pipeline, graph_pass
from qcompile.passes.trace import shape_prop, trace
from qcompile.passes.trace.model_copy import MetaCopy, copy_model

FALLBACK = "example inputs (ran the model on them: "


# -- helpers --------------------------------------------------------------------------


def compile_none(model: nn.Module, *inputs, spec: dict | None = None):
    """qc.qcompile with quantization off: the graph is the trace pass's own output."""
    return qc.qcompile(model, spec or {}, example_inputs=inputs)


class _LeafTracer(torch.fx.Tracer):
    def __init__(self, leaves: tuple[type, ...]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return isinstance(m, self.leaves) or super().is_leaf_module(m, qualified_name)


def reference(model: nn.Module, *inputs, leaves: tuple[type, ...] = ()) -> torch.fx.GraphModule:
    """torch's ShapeProp on a symbolic trace of an eval copy, under no_grad."""
    root = copy.deepcopy(model).eval()
    gm = torch.fx.GraphModule(root, _LeafTracer(leaves).trace(root))
    with torch.no_grad():
        ShapeProp(gm).propagate(*inputs)
    return gm


def summary(meta):
    """(shape, dtype, requires_grad) per tensor, containers kept, other values as they are."""
    if isinstance(meta, TensorMetadata):
        return (tuple(meta.shape), meta.dtype, meta.requires_grad)
    if isinstance(meta, tuple):
        return tuple(summary(m) for m in meta)
    if isinstance(meta, list):
        return [summary(m) for m in meta]
    if isinstance(meta, dict):
        return {k: summary(v) for k, v in meta.items()}
    return meta


def assert_same_shapes(gm: torch.fx.GraphModule, ref: torch.fx.GraphModule) -> int:
    """Every node's tensor_meta (and result type) equal to the reference's; returns how
    many nodes carry a tensor_meta."""
    ours = {n.name: n for n in gm.graph.nodes}
    theirs = {n.name: n for n in ref.graph.nodes}
    assert list(ours) == list(theirs)
    with_meta = 0
    for name, r in theirs.items():
        n = ours[name]
        assert ("tensor_meta" in n.meta) == ("tensor_meta" in r.meta), name
        if "tensor_meta" in r.meta:
            with_meta += 1
            assert summary(n.meta["tensor_meta"]) == summary(r.meta["tensor_meta"]), name
        assert n.meta.get("type") == r.meta.get("type"), name
    assert with_meta > 0
    return with_meta


def check_against_shapeprop(model: nn.Module, *inputs, spec: dict | None = None,
                            leaves: tuple[type, ...] = ()) -> str:
    """Compile, compare with ShapeProp, return ``Report.shapes``."""
    gm = compile_none(model, *inputs, spec=spec)
    assert_same_shapes(gm, reference(model, *inputs, leaves=leaves))
    return qc.report(gm).shapes


@pytest.fixture
def counted(monkeypatch):
    """Counts of memo hits (``_rebuild``) and stock fast paths taken (``_stock_output``)."""
    counts = {"memo": 0, "stock": 0}
    rebuild, stock = shape_prop._rebuild, shape_prop._stock_output

    def counting_rebuild(template):
        counts["memo"] += 1
        return rebuild(template)

    def counting_stock(m, args, kwargs):
        out = stock(m, args, kwargs)
        counts["stock"] += out is not None
        return out

    monkeypatch.setattr(shape_prop, "_rebuild", counting_rebuild)
    monkeypatch.setattr(shape_prop, "_stock_output", counting_stock)
    return counts


# -- models ---------------------------------------------------------------------------


def mlp(d_in: int, hidden: int, d_out: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(d_in, hidden), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(hidden, d_out))


class CNN(nn.Module):
    def __init__(self, c_in: int = 3, ch: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, ch, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(ch)
        self.relu1 = nn.ReLU()
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.conv2 = nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * ch)
        self.relu2 = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(2 * ch, classes)

    def forward(self, x):
        x = self.pool(self.relu1(self.bn1(self.conv1(x))))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc(self.flatten(self.gap(x)))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class TransformerBlock(nn.Module):
    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


class Transformer(nn.Module):
    """Identical blocks: from the second block on, every call repeats the first's."""

    def __init__(self, d: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[TransformerBlock(d) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.frozen = nn.Parameter(torch.randn(d, 3), requires_grad=False)  # get_attr
        self.head = nn.Parameter(torch.randn(3, 2))  # get_attr, trainable

    def forward(self, x):
        return self.norm(self.blocks(x)) @ self.frozen @ self.head


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)  # returns a tuple

    def forward(self, x):
        a, b = torch.split(self.fc(x), [3, 5], dim=-1)
        out, weights = self.mha(self.fc(x), self.fc(x), self.fc(x))
        top = torch.max(out, dim=-1)  # a structseq (values, indices)
        return a, (b, weights), [top.values, top.indices], {"sum": out.sum(1), "n": x.size(0)}


class Misc(nn.Module):
    """Integer, boolean and half-precision values, embeddings, an LSTM, factories."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lstm = nn.LSTM(8, 6, batch_first=True)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, idx, x):
        e = self.emb(idx)
        o, (h, c) = self.lstm(e)
        m = torch.argmax(o, dim=-1)
        z = o.masked_fill(o > 0, 0.0).cumsum(1).half()
        r = torch.arange(x.size(1)) + m.sum()
        b = self.bn(o.flatten(0, 1))
        lin = F.linear(x, torch.ones(7, x.size(1)))
        return z, h + c, r, b, lin, m // 2, m / 3, (x > 0).any()


# -- 1. meta tensors agree with torch's ShapeProp -------------------------------------


@settings(max_examples=15)
@given(batch=st.integers(1, 6), d_in=st.integers(1, 12), hidden=st.integers(1, 16),
       d_out=st.integers(1, 8), depth=st.integers(0, 3), lead=st.integers(0, 2))
def test_mlp_matches_shapeprop(batch, d_in, hidden, d_out, depth, lead):
    torch.manual_seed(0)
    model = mlp(d_in, hidden, d_out, depth)
    x = torch.randn(*([2] * lead), batch, d_in)  # Linear on extra leading dims
    assert check_against_shapeprop(model, x) == "meta tensors"


@settings(max_examples=12)
@given(batch=st.integers(1, 4), c_in=st.integers(1, 4), ch=st.integers(1, 6),
       h=st.integers(3, 13), w=st.integers(3, 13), channels_last=st.booleans())
def test_cnn_matches_shapeprop(batch, c_in, ch, h, w, channels_last):
    torch.manual_seed(0)
    model = CNN(c_in, ch)
    x = torch.randn(batch, c_in, h, w)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    assert check_against_shapeprop(model, x) == "meta tensors"


@settings(max_examples=40)
@given(d=st.integers(1, 3), c_in=st.integers(1, 4), groups=st.sampled_from([1, 2]),
       k=st.integers(1, 4), stride=st.integers(1, 3), pad=st.sampled_from([0, 1, 2, "same",
                                                                          "valid"]),
       dilation=st.integers(1, 2), n=st.integers(1, 9), batch=st.integers(1, 2))
def test_convolution_shapes_by_formula_match_the_meta_kernel(d, c_in, groups, k, stride, pad,
                                                              dilation, n, batch):
    """The stock Conv1d/2d/3d fast path gives torch's meta kernel's output (shape, dtype,
    strides), or steps aside where the kernel would raise."""
    if pad == "same":
        stride = 1
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[d - 1](c_in * groups, 3 * groups, k,
                                                     stride=stride, padding=pad,
                                                     dilation=dilation, groups=groups)
    x = torch.empty(batch, c_in * groups, *[n] * d, device="meta")
    fast = shape_prop._stock_output(conv, (x,), {})
    try:
        with torch.no_grad():
            slow = MetaCopy().module(conv)(x)
    except RuntimeError:
        assert fast is None
        return
    assert fast is not None
    assert (fast.shape, fast.stride(), fast.dtype) == (slow.shape, slow.stride(), slow.dtype)


@settings(max_examples=30)
@given(d=st.integers(1, 3), size=st.sampled_from([1, 2, 3, "mixed"]),
       batched=st.booleans(), n=st.integers(1, 6))
def test_adaptive_average_pooling_by_formula_matches_the_meta_kernel(d, size, batched, n):
    if size == "mixed":  # None: the input's size along that dim
        size = (2, None, 1)[:d] if d > 1 else 2
    pool = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)[d - 1](size)
    x = torch.empty(*([2, 3] if batched else [3]), *[n] * d, device="meta")
    fast = shape_prop._stock_output(pool, (x,), {})
    slow = MetaCopy().module(pool)(x)
    assert fast is not None
    assert (fast.shape, fast.stride(), fast.dtype) == (slow.shape, slow.stride(), slow.dtype)


def test_cnn_in_train_mode_matches_shapeprop():
    torch.manual_seed(0)
    model = CNN().train()
    x = torch.randn(1, 3, 9, 7)  # batch 1: a train-mode BatchNorm would refuse it
    assert check_against_shapeprop(model, x) == "meta tensors"


def test_transformer_matches_shapeprop_and_reuses_repeated_calls(counted):
    torch.manual_seed(0)
    model = Transformer(d=16, depth=3)
    x = torch.randn(2, 5, 16, requires_grad=True)
    assert check_against_shapeprop(model, x) == "meta tensors"
    # the memo and the stock fast paths (LayerNorm, Linear, GELU) were taken, so their
    # results are what was compared above
    assert counted["memo"] > 10
    assert counted["stock"] > 0


def test_transformer_input_and_parameters_keep_requires_grad():
    torch.manual_seed(0)
    model = Transformer(d=8, depth=2)
    gm = compile_none(model, torch.randn(1, 3, 8, requires_grad=True))
    metas = {n.name: n.meta["tensor_meta"] for n in gm.graph.nodes if "tensor_meta" in n.meta}
    assert metas["x"].requires_grad is True
    assert metas["head"].requires_grad is True
    assert metas["frozen"].requires_grad is False
    assert metas["matmul_1"].requires_grad is False  # computed under no_grad


def test_tuple_list_dict_outputs_match_shapeprop():
    torch.manual_seed(0)
    assert check_against_shapeprop(TupleOut(), torch.randn(3, 4, 6)) == "meta tensors"


def test_integer_bool_half_lstm_match_shapeprop():
    torch.manual_seed(0)
    idx = torch.randint(0, 10, (2, 5))
    assert check_against_shapeprop(Misc(), idx, torch.randn(3, 4)) == "meta tensors"


def test_channels_last_convolutions_with_repeats_match_shapeprop(counted):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4),
                                          nn.ReLU()) for _ in range(3)])
    x = torch.randn(2, 4, 6, 5).to(memory_format=torch.channels_last)
    assert check_against_shapeprop(model, x) == "meta tensors"
    assert counted["memo"] > 0


def test_meta_run_does_not_consume_the_global_rng():
    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.randn_like(x) + F.dropout(x, 0.5, training=True)

    x = torch.randn(2, 3)
    rng = torch.get_rng_state()
    gm = compile_none(Noisy(), x)
    assert qc.report(gm).shapes == "meta tensors"
    assert torch.equal(torch.get_rng_state(), rng)


def test_memo_keeps_aliases_for_in_place_shape_changes():
    class Alias(nn.Module):
        def forward(self, x, y):
            x2 = x.contiguous()  # runs; the memo records it
            y2 = y.contiguous()  # same key: a fresh meta tensor, really y itself
            y2.unsqueeze_(0)  # really changes y's shape to (1, 2, 3)
            return x2 + y  # really (1, 2, 3)

    assert check_against_shapeprop(Alias(), torch.randn(2, 3), torch.randn(2, 3))


# -- 2. fallbacks to a real run -------------------------------------------------------


class Gate(nn.Module):
    """Branches on a value: meta tensors cannot say which way."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -x[:, :2]  # another shape: the recorded shape depends on the branch taken


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.post = nn.Linear(4, 3)

    def forward(self, x):
        y = self.gate(x)
        return y * 2, self.post(x)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
def test_leaf_module_branching_on_a_value_falls_back(sign):
    torch.manual_seed(0)
    x = sign * torch.rand(3, 4)
    shapes = check_against_shapeprop(Gated(), x, spec={"trace": {"leaf_modules": ["Gate"]}},
                                     leaves=(Gate,))
    assert shapes.startswith(FALLBACK)
    assert "node 'gate' (call_module gate) is a leaf module with its own forward (Gate)" in shapes
    gm = compile_none(Gated(), x, spec={"trace": {"leaf_modules": ["Gate"]}})
    gate = next(n for n in gm.graph.nodes if n.name == "gate")
    assert tuple(gate.meta["tensor_meta"].shape) == ((3, 4) if sign > 0 else (3, 2))
    assert "shapes from example inputs" in qc.report(gm).text()


class ItemScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y * y.abs().max().item()


def test_item_falls_back():
    torch.manual_seed(0)
    shapes = check_against_shapeprop(ItemScale(), torch.randn(3, 4))
    assert shapes.startswith(FALLBACK)
    assert "node 'item' (call_method item) cannot run on meta tensors" in shapes


class NonZero(nn.Module):
    def forward(self, x):
        idx = torch.nonzero(x > 0)
        return idx, idx.float().mean(0)


def test_nonzero_falls_back_with_the_data_dependent_shape():
    x = torch.tensor([[1.0, -1.0, 2.0], [0.0, 3.0, -4.0]])  # 3 positives
    shapes = check_against_shapeprop(NonZero(), x)
    assert shapes.startswith(FALLBACK)
    assert "node 'nonzero' (call_function nonzero) cannot run on meta tensors" in shapes
    gm = compile_none(NonZero(), x)
    nz = next(n for n in gm.graph.nodes if n.name == "nonzero")
    assert tuple(nz.meta["tensor_meta"].shape) == (3, 2)
    assert nz.meta["tensor_meta"].dtype == torch.int64


class PromoteBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("offset", torch.ones(4, dtype=torch.float64))

    def forward(self, x):
        return self.fc(x) + self.offset  # float32 + float64: float64, as real kernels do


def test_mixed_float_dtypes_fall_back_and_promote():
    torch.manual_seed(0)
    shapes = check_against_shapeprop(PromoteBuffer(), torch.randn(2, 4))
    assert shapes.startswith(FALLBACK)
    assert "node 'add' (call_function add) mixes floating-point dtypes (float32, float64)" \
        in shapes
    gm = compile_none(PromoteBuffer(), torch.randn(2, 4))
    out = next(n for n in gm.graph.nodes if n.name == "add")
    assert out.meta["tensor_meta"].dtype == torch.float64


def test_float64_input_to_a_float32_linear_still_raises_the_clear_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(qc.QCompileError) as info:
        compile_none(model, torch.randn(3, 4, dtype=torch.float64))
    err = info.value
    assert err.message.startswith("running node '_0' (")
    assert ("on the example inputs failed: RuntimeError: mat1 and mat2 must have the same "
            "dtype, but got Double and Float") in err.message
    assert "example_inputs" in err.fix


class CastsInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x.double())  # float64 into a float32 Linear: real kernels refuse


class HoldsCastsInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = CastsInside()

    def forward(self, x):
        return self.inner(x)


def test_dtype_mix_inside_a_leaf_module_still_raises():
    with pytest.raises(qc.QCompileError, match="mat1 and mat2 must have the same dtype"):
        compile_none(HoldsCastsInside(), torch.randn(2, 4),
                     spec={"trace": {"leaf_modules": ["CastsInside"]}})


# -- 3. nothing is mutated ------------------------------------------------------------


class TrainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(self.drop(self.relu(self.bn(self.conv(x)))).flatten(1))


class TrainNetItem(TrainNet):
    """The same, with an ``.item()``: shapes come from a real run."""

    def forward(self, x):
        y = super().forward(x)
        return y / y.abs().max().item()


def _storages(tensors) -> set[int]:
    """The storage objects (not their addresses: reading one would make a copy-on-write
    clone copy itself)."""
    return {t.untyped_storage()._cdata for t in tensors}


@pytest.mark.parametrize(("cls", "spec", "how"), [
    (TrainNet, "int8-qat", "meta tensors"),
    (TrainNetItem, "int8-qat", FALLBACK),
    (TrainNetItem, {}, FALLBACK),
], ids=["qat-meta", "qat-fallback", "none-fallback"])
def test_compile_leaves_model_stats_rng_and_parameters_alone(cls, spec, how):
    torch.manual_seed(0)
    model = cls().train()
    with torch.no_grad():  # non-trivial running stats
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {name: m.training for name, m in model.named_modules()}
    x = torch.randn(2, 3, 8, 8)
    x_before = x.clone()
    rng = torch.get_rng_state()

    gm = qc.qcompile(model, spec, example_inputs=(x,))

    assert qc.report(gm).shapes.startswith(how)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(x, x_before)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert int(model.bn.num_batches_tracked) == 0
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert all(not p.is_meta for p in model.parameters())
    # the graph holds real copies of the model's tensors, in the model's train/eval modes
    state = gm.state_dict()
    assert all(not t.is_meta for t in state.values())
    for k, v in before.items():
        assert torch.equal(state[k], v), k
    assert not _storages(model.state_dict().values()) & _storages(state.values())
    assert gm.training and gm.get_submodule("bn").training
    assert gm.get_submodule("drop").training


def test_fallback_run_leaves_the_rng_alone_with_random_ops():
    class NoisyItem(nn.Module):
        def forward(self, x):
            y = x + torch.randn_like(x)
            return y / y.abs().max().item()

    x = torch.randn(2, 3)
    rng = torch.get_rng_state()
    gm = compile_none(NoisyItem(), x)
    assert qc.report(gm).shapes.startswith(FALLBACK)
    assert torch.equal(torch.get_rng_state(), rng)


# -- 4. copy_model against copy.deepcopy ----------------------------------------------


def _tensors(m: nn.Module) -> list[torch.Tensor]:
    out = [t for _, t in m.named_parameters(remove_duplicate=False)]
    out += [t for _, t in m.named_buffers(remove_duplicate=False)]
    return out


def _sharing(m: nn.Module) -> list[list[str]]:
    """Which names refer to one object: modules, then parameters and buffers."""
    groups: dict[int, list[str]] = {}
    for name, sub in m.named_modules(remove_duplicate=False):
        groups.setdefault(id(sub), []).append(f"module:{name}")
    for name, t in m.named_parameters(remove_duplicate=False):
        groups.setdefault(id(t), []).append(f"param:{name}")
    for name, t in m.named_buffers(remove_duplicate=False):
        groups.setdefault(id(t), []).append(f"buffer:{name}")
    return sorted(groups.values())


def check_copy(model: nn.Module, *inputs) -> nn.Module:
    """copy_model(model) equals copy.deepcopy(model) in every observable way checked here."""
    ours, theirs = copy_model(model), copy.deepcopy(model)
    assert ours is not model
    for c in (ours, theirs):
        assert [(n, type(m), m.training) for n, m in c.named_modules()] == \
            [(n, type(m), m.training) for n, m in model.named_modules()]
        assert _sharing(c) == _sharing(model)
        sd, ref = c.state_dict(), model.state_dict()
        assert sd.keys() == ref.keys()
        for k in ref:
            assert torch.equal(sd[k], ref[k]), k
            assert sd[k].requires_grad == ref[k].requires_grad, k
        assert [(n, p.requires_grad) for n, p in c.named_parameters()] == \
            [(n, p.requires_grad) for n, p in model.named_parameters()]
        assert not _storages(_tensors(c)) & _storages(_tensors(model))
        assert not {id(m) for m in c.modules()} & {id(m) for m in model.modules()}
    if inputs:
        with torch.no_grad():
            expected = model(*inputs)
            assert torch.equal(ours(*inputs), expected)
            assert torch.equal(theirs(*inputs), expected)
    return ours


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.again = self.block  # one module reached twice

    def forward(self, idx):
        return self.head(self.again(self.block(self.emb(idx))))


def test_copy_model_tied_weights_and_shared_modules():
    torch.manual_seed(0)
    model = TiedLM()
    c = check_copy(model, torch.randint(0, 11, (2, 4)))
    assert c.head.weight is c.emb.weight
    assert c.again is c.block
    with torch.no_grad():
        c.emb.weight.zero_()
    assert torch.count_nonzero(c.head.weight) == 0
    assert torch.count_nonzero(model.head.weight) > 0


class StatefulSetstate(nn.Linear):
    """A module class with its own ``__getstate__`` / ``__setstate__`` (as Conv has one)."""

    def __getstate__(self):
        state = super().__getstate__()
        state["saved_by_getstate"] = True
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.set_by_setstate = True


def test_copy_model_modules_with_their_own_getstate_setstate():
    """deepcopy copies them through their own __getstate__ / __setstate__; so does
    copy_model (Conv's fills in padding_mode), and plain parameters are clones with the
    original's requires_grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
                          nn.BatchNorm2d(4), nn.Flatten(), StatefulSetstate(4 * 5 * 5, 2))
    model[0].bias.requires_grad_(False)
    c = check_copy(model, torch.randn(2, 3, 5, 5))
    theirs = copy.deepcopy(model)
    assert c[0].padding_mode == "reflect" and type(c[0]) is nn.Conv2d
    assert c[3].saved_by_getstate and c[3].set_by_setstate
    assert vars(c[3]).keys() == vars(theirs[3]).keys()
    assert type(c[0].weight) is nn.Parameter and not c[0].bias.requires_grad
    assert c[0].weight._version == theirs[0].weight._version


def test_meta_copy_converts_on_demand_and_keeps_ties_across_calls():
    """Shape propagation converts only what the run reaches; what two calls reach stays
    one object (a tied weight, a shared module)."""
    model = TiedLM()
    metas = MetaCopy()
    head = metas.module(model.head)
    assert head.weight.device.type == "meta" and id(model.block) not in metas.modules
    assert metas.module(model.emb).weight is head.weight
    assert metas.module(model.again) is metas.module(model.block)
    assert model.head.weight.device.type == "cpu" and model.head.training


@pytest.mark.skipif(not hasattr(torch, "_lazy_clone"), reason="no copy-on-write clones")
def test_copy_model_is_copy_on_write_where_safe_and_eager_elsewhere():
    """Plain parameters and buffers are copy-on-write clones (no copy until written);
    views into a bigger storage and shared memory are copied at once. Either way, what
    one side writes never reaches the other, in both directions."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.Linear(2, 2))
    flat = torch.randn(32)
    model[2].weight = nn.Parameter(flat[:8].view(2, 4))  # a view into a flat buffer
    model[3].weight.data.share_memory_()  # other processes may write it
    model[3].bias = nn.Parameter(torch.from_numpy(np.ones(2, dtype=np.float32)))  # not torch's
    model.register_buffer("pair", torch.ones(4))
    model.register_buffer("pair_view", model.pair.view(2, 2))  # deepcopy keeps them tied
    before = {k: v.clone() for k, v in model.state_dict().items()}
    c = copy_model(model)
    cow = torch._C._is_cow_tensor
    assert cow(c[0].weight) and cow(c[0].bias) and cow(c[1].running_var) and cow(c.pair)
    assert not cow(c[2].weight) and not cow(c[3].weight) and not cow(c[3].bias)
    assert not cow(model[2].weight) and not cow(model[3].weight)
    # the copy trains: parameters, running stats, a tied buffer pair
    c.train()
    c(torch.randn(8, 4)).square().sum().backward()
    torch.optim.Adam(c.parameters(), lr=0.1).step()
    with torch.no_grad():
        c.pair.add_(1)
    assert c.pair_view.tolist() == [[2.0, 2.0], [2.0, 2.0]]
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the model is written after the copy was made
    copied = {k: v.clone() for k, v in c.state_dict().items()}
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.add_(1)
    for k, v in c.state_dict().items():
        assert torch.equal(v, copied[k]), k


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def test_copy_model_parametrizations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 3))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    parametrizations.weight_norm(model[2])
    c = check_copy(model, torch.randn(2, 5))
    assert parametrize.is_parametrized(c[0], "weight")
    assert parametrize.is_parametrized(c[2], "weight")
    assert torch.equal(c[0].weight, c[0].weight.T)
    original = c[0].parametrizations.weight.original
    assert original is not model[0].parametrizations.weight.original
    with torch.no_grad():
        original.fill_(1.0)
    assert not torch.equal(model[0].weight, c[0].weight)


def test_copy_model_old_weight_norm_fails_like_deepcopy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(nn.utils.weight_norm(nn.Linear(3, 3)))
    with pytest.raises(RuntimeError) as theirs:
        copy.deepcopy(model)
    with pytest.raises(RuntimeError) as ours:
        copy_model(model)
    assert str(ours.value) == str(theirs.value)


def test_copy_model_old_weight_norm_after_removal():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin = nn.utils.weight_norm(nn.Linear(3, 3))
        nn.utils.remove_weight_norm(lin)
    check_copy(nn.Sequential(lin, nn.Tanh()), torch.randn(2, 3))


class Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("shift", torch.arange(4.0), persistent=False)
        self.register_buffer("absent", None)
        self.table = torch.linspace(0, 1, 4)  # a plain tensor attribute

    def forward(self, x):
        return self.fc(x) * self.scale + self.shift + self.table


def test_copy_model_buffers_persistent_non_persistent_and_tensor_attributes():
    torch.manual_seed(0)
    model = Buffers()
    c = check_copy(model, torch.randn(2, 4))
    assert "shift" not in c.state_dict() and "shift" in dict(c.named_buffers())
    assert c._non_persistent_buffers_set == {"shift"}
    assert c._non_persistent_buffers_set is not model._non_persistent_buffers_set
    assert c.absent is None and "absent" in c._buffers
    assert torch.equal(c.shift, model.shift) and torch.equal(c.table, model.table)
    assert c.table.untyped_storage().data_ptr() != model.table.untyped_storage().data_ptr()


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.calls = 0
        self.register_forward_hook(self.count)
        self.fc.register_forward_pre_hook(lambda m, args: (args[0] * 2,))

    def count(self, module, args, output):
        self.calls += 1
        return output + 1

    def forward(self, x):
        return self.fc(x)


def test_copy_model_hooks_are_copied_and_bound_to_the_copy():
    torch.manual_seed(0)
    model = Hooked()
    x = torch.randn(2, 3)
    c = check_copy(model, x)  # (outputs compared: both hooks ran on the copies too)
    with torch.no_grad():
        expected = F.linear(2 * x, model.fc.weight, model.fc.bias) + 1
        assert torch.allclose(c(x), expected)
    hook = next(iter(c._forward_hooks.values()))
    assert hook.__self__ is c
    calls = model.calls
    with torch.no_grad():
        c(x)
    assert model.calls == calls  # the copy's hook counts on the copy
    assert c.calls > 0


class Configured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.sizes = [1, 2, 3]
        self.config = {"scale": 0.5, "names": ["a", "b"]}
        self.log: list[str] = []
        self.name = "configured"
        self.dims = (1, 2)

    def forward(self, x):
        return self.fc(x) * self.config["scale"] + len(self.sizes)


def test_copy_model_plain_python_attributes():
    torch.manual_seed(0)
    model = Configured()
    c = check_copy(model, torch.randn(2, 3))
    assert c.sizes == model.sizes and c.sizes is not model.sizes
    assert c.config == model.config and c.config is not model.config
    assert c.config["names"] is not model.config["names"]
    assert c.log == [] and c.log is not model.log
    c.log.append("x")
    c.sizes.append(4)
    c.config["names"].append("c")
    assert model.log == [] and model.sizes == [1, 2, 3] and model.config["names"] == ["a", "b"]
    assert (c.name, c.dims) == ("configured", (1, 2))


def test_copy_model_back_reference_to_the_root():
    torch.manual_seed(0)
    model = Configured()
    object.__setattr__(model.fc, "owner", model)  # a cycle outside _modules
    c = check_copy(model, torch.randn(2, 3))
    assert c.fc.owner is c


class Logger(nn.Module):
    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log


class SharedLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        log: list[str] = []
        self.a = Logger(log)
        self.b = Logger(log)


def test_copy_model_keeps_a_shared_non_empty_list_shared():
    model = SharedLog()
    model.a.log.append("start")
    c = check_copy(model)
    assert c.a.log is c.b.log and c.a.log is not model.a.log


def test_copy_model_keeps_a_shared_empty_list_shared():
    model = SharedLog()
    theirs = copy.deepcopy(model)
    assert theirs.a.log is theirs.b.log
    ours = copy_model(model)
    assert ours.a.log is ours.b.log


# -- 5. the pipeline recompiles changed graphs only -----------------------------------


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) - 10.0  # mostly negative: a relu on the output shows


@graph_pass(requires=("graph",), provides=("relu",))
def add_relu(gm, ctx):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    with gm.graph.inserting_before(out):
        relu = gm.graph.call_function(torch.relu, (value,))
    out.args = (relu,)
    return gm


@graph_pass(requires=("graph",), provides=("sigmoid",))
def relu_to_sigmoid(gm, ctx):
    for n in gm.graph.nodes:
        if n.target is torch.relu:
            n.target = torch.sigmoid  # in place: same nodes, same arguments
    return gm


@graph_pass(requires=("graph",), provides=("annotated",))
def annotate_only(gm, ctx):
    for n in gm.graph.nodes:
        n.meta["seen"] = True
    return gm


def _run(passes, model, *inputs):
    ctx = Context(spec=qc.CompileSpec(), model=model, example_inputs=inputs)
    return Pipeline(passes).run(ctx)


def test_pipeline_recompiles_after_a_pass_edits_the_graph():
    torch.manual_seed(0)
    model = Affine()
    x = torch.randn(5, 4)
    seen = {}

    @graph_pass(requires=("relu",), provides=("ran",))
    def run(gm, ctx):
        seen["code"] = gm.code
        with torch.no_grad():
            seen["out"] = gm(x)
        return gm

    gm, _ = _run([trace, add_relu, run], model, x)
    with torch.no_grad():
        expected = torch.relu(model(x))
    assert (model(x) < 0).any()  # the relu makes a difference
    assert "torch.relu" in seen["code"]
    assert torch.equal(seen["out"], expected)
    assert torch.equal(gm(x), expected)


def test_pipeline_recompiles_after_an_in_place_target_change():
    torch.manual_seed(0)
    model = Affine()
    x = torch.randn(5, 4)
    seen = {}

    @graph_pass(requires=("sigmoid",), provides=("ran",))
    def run(gm, ctx):
        with torch.no_grad():
            seen["out"] = gm(x)
        return gm

    _run([trace, add_relu, relu_to_sigmoid, run], model, x)
    with torch.no_grad():
        assert torch.equal(seen["out"], torch.sigmoid(model(x)))


def test_pipeline_does_not_recompile_an_unchanged_graph(monkeypatch):
    torch.manual_seed(0)
    model = Affine()
    x = torch.randn(5, 4)
    codes = []

    recompiles = []

    @graph_pass(requires=("graph",), provides=("unchanged",))
    def nothing(gm, ctx):
        recompiles.clear()  # building the GraphModule in trace compiled it once
        codes.append(gm.code)
        return gm

    @graph_pass(requires=("annotated",), provides=("done",))
    def after(gm, ctx):
        codes.append(gm.code)
        return gm

    real = torch.fx.GraphModule.recompile

    def counting(self):
        recompiles.append(self)
        return real(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counting)
    gm, records = _run([trace, nothing, annotate_only, after], model, x)
    assert recompiles == []  # no pass after trace changed the graph
    assert codes[0] == codes[1] == gm.code
    assert all(n.meta["seen"] for n in gm.graph.nodes)
    assert [r.name for r in records] == ["trace", "nothing", "annotate_only", "after"]

    gm, _ = _run([trace, nothing, add_relu, annotate_only], model, x)
    assert recompiles == [gm]  # after add_relu only
    assert "torch.relu" in gm.code
