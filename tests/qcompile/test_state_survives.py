"""A compiled graph's state survives saving, loading and copying at any point in training.

A graph ``A`` is trained to a point (just compiled; a training forward and backward with no
optimizer step yet; two of them, mid gradient accumulation; an optimizer step; ``qc.freeze``;
``qc.calibrate``), then copied four ways: ``torch.save`` / ``torch.load``,
``state_dict`` / ``load_state_dict`` into a freshly compiled graph, torch.distributed.checkpoint
(``dcp.save`` / ``dcp.load``, one process, no process group) into one, and ``copy.deepcopy``.
``A`` and its copies then train on in lockstep (the same batches, the same SGD steps): every
training forward's output, the final evaluation output and every quantizer's state (qparams,
observer statistics, pending step statistics, flags) and weight must be equal bit for bit.
The reference is ``A`` itself, trained without interruption.

Step updates (``quant.observer_update: step``) are what is at stake: a training forward folds
its statistics into pending ones that the graph's first forward after the optimizer step
applies; a copy taken between must apply them then too, once.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import qcompile as qc
from qcompile.tools.architectures import ARCHITECTURES


class CNN(nn.Module):
    """conv-bn-relu (BatchNorm kept and trained under QAT), then Linear layers whose input
    widths (128, 64) split into int4 groups of 32 and NF4 blocks of 64; ``head`` is what
    the qlora preset keeps in float."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(128, 64), act=nn.ReLU(),
                                             fc2=nn.Linear(64, 64)))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(x)))
        return self.head(torch.relu(self.mlp(torch.flatten(y, 1))))


def spec(name: str) -> dict:
    if name == "lsq":
        rule = {"weight": {"dtype": "int8", "granularity": "per_channel", "learnable": True},
                "activation": {"dtype": "uint8", "symmetric": False, "learnable": True}}
        return {"quant": {"mode": "qat", "rules": [
            {"match": {"module": ["Conv2d", "Linear"]}, **rule}]}}
    out = qc.load_spec("int8-qat" if name in ("forward", "staged") else name).model_dump()
    if name == "forward":
        out["quant"]["observer_update"] = "forward"
    if name == "staged":
        out["pipeline"] = {"stages": 2}
    return out


@dataclass(frozen=True)
class Task:
    """How to build, feed and score one model."""

    build: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, torch.Tensor]]
    loss: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]
    export: bool  # compile through torch.export (else symbolic tracing)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return CNN()


def _cnn_batch(seed: int) -> dict[str, torch.Tensor]:
    # a growing scale: each step's activation ranges differ, so a lost, early or doubled
    # application of pending statistics changes the qparams
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, 3, 4, 4, generator=gen) * (1 + seed)}


def _hf(name: str) -> Task:
    arch = ARCHITECTURES[name]

    return Task(build=arch.build, batch=lambda seed: arch.batch(seed=seed), loss=arch.loss,
                export=True)


TASKS = {
    "cnn": Task(build=_cnn, batch=_cnn_batch, loss=lambda out, b: out.square().mean(),
                export=False),
    "llama": _hf("llama"),
    "mixtral": _hf("mixtral"),
}


def output(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out["logits"]


def compile_graph(task: str, spec_name: str) -> torch.fx.GraphModule:
    t = TASKS[task]
    model = t.build()
    if spec_name == "qlora-nf4":
        model.requires_grad_(False)  # the preset's recipe: only the adapters train
    s = spec(spec_name)
    s["trace"] = {**s.get("trace", {}), "method": "export" if t.export else "symbolic"}
    return qc.qcompile(model, s, example_kwargs=t.batch(100))


@pytest.fixture(scope="module")
def pristine() -> Callable[[str, str], torch.fx.GraphModule]:
    """One freshly compiled, never run graph per (model, spec): the targets the state-dict
    routes load into are deep copies of it (a copy of a graph that never ran is a freshly
    compiled graph; compiling a Hugging Face model again per case would cost seconds)."""
    made: dict[tuple[str, str], torch.fx.GraphModule] = {}

    def get(task: str, spec_name: str) -> torch.fx.GraphModule:
        if (task, spec_name) not in made:
            made[task, spec_name] = compile_graph(task, spec_name)
        return made[task, spec_name]

    return get


def trainable(gm: nn.Module) -> list[nn.Parameter]:
    return [p for p in gm.parameters() if p.requires_grad]


def train_forward(gm: nn.Module, task: Task, seed: int) -> torch.Tensor:
    b = task.batch(seed)
    out = gm(**b)
    task.loss(out, b).backward()
    return output(out).detach()


def to_point(gm: nn.Module, task: Task, point: str) -> None:
    """Train ``gm`` to ``point``."""
    opt = torch.optim.SGD(trainable(gm), lr=0.05)
    if point in ("forward", "accumulating", "stepped", "frozen"):
        train_forward(gm, task, 1)
    if point == "accumulating":
        train_forward(gm, task, 2)  # the second micro-batch of the same step
    if point in ("stepped", "frozen"):
        opt.step()
    if point == "frozen":
        opt.zero_grad()
        train_forward(gm, task, 2)  # pending statistics, applied by freeze
        qc.freeze(gm)
    if point == "calibrated":
        qc.calibrate(gm, [task.batch(s) for s in (1, 2)], progress=False)


# -- the four ways of copying ------------------------------------------------------------------
def saved(gm: nn.Module, fresh: nn.Module, tmp: Any) -> nn.Module:
    f = io.BytesIO()
    torch.save(gm, f)
    f.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation
        return torch.load(f, weights_only=False)


def state_dict(gm: nn.Module, fresh: nn.Module, tmp: Any) -> nn.Module:
    f = io.BytesIO()
    torch.save(gm.state_dict(), f)  # the safe recipe: tensors only
    f.seek(0)
    fresh.load_state_dict(torch.load(f, weights_only=True))  # strict
    return fresh


def checkpoint(gm: nn.Module, fresh: nn.Module, tmp: Any) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
        dcp.save({"model": get_model_state_dict(gm)}, checkpoint_id=tmp)
        state = {"model": get_model_state_dict(fresh)}
        dcp.load(state, checkpoint_id=tmp)
    set_model_state_dict(fresh, state["model"])
    return fresh


def deep_copy(gm: nn.Module, fresh: nn.Module, tmp: Any) -> nn.Module:
    return copy.deepcopy(gm)


COPIES = {"torch.save": saved, "state_dict": state_dict, "dcp": checkpoint,
          "deepcopy": deep_copy}


# -- comparing ----------------------------------------------------------------------------------
def ready(q: qc.FakeQuantize) -> bool:
    obs = q.observer
    return q.initialised or (obs is not None and bool(torch.isfinite(obs.min_val).any()))


def assert_same_state(a: nn.Module, b: nn.Module, what: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), what
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), f"{what}: {k}"
    for (name, qa), qb in zip(qc.quantizers(a).items(), qc.quantizers(b).values(), strict=True):
        assert (qa.enabled, qa.observe) == (qb.enabled, qb.observe), f"{what}: {name}"
        # ``initialised`` caches "the observer has statistics", set by the first forward
        # that finds them: compared as what a forward acts on
        assert ready(qa) == ready(qb), f"{what}: {name} initialised"
        pa, pb = qa.pending_stats(), qb.pending_stats()
        assert (pa is None) == (pb is None), f"{what}: {name} pending statistics"
        if pa is not None:
            assert torch.equal(pa[0], pb[0]) and torch.equal(pa[1], pb[1]), f"{what}: {name}"
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q) and p.requires_grad == q.requires_grad, f"{what}: {name}"


def check(task_name: str, spec_name: str, point: str, pristine: Any, tmp_path: Any) -> None:
    task = TASKS[task_name]
    a = compile_graph(task_name, spec_name)  # the reference: never copied
    to_point(a, task, point)
    graphs = {"original": a}
    for how, make in COPIES.items():
        # (a deep copy of a pipeline graph loses the attributes torch.distributed.checkpoint
        # resolves the model's names by, passes/place.py register_original_names: compiled)
        fresh = (compile_graph(task_name, spec_name) if spec_name == "staged"
                 else copy.deepcopy(pristine(task_name, spec_name)))
        graphs[how] = make(a, fresh, tmp_path / how)
        # gradients are not model state (no route carries them): mid-accumulation, the copy
        # resumes with the original's
        grads = {n: p.grad for n, p in a.named_parameters()}
        for n, p in graphs[how].named_parameters():
            p.grad = None if grads[n] is None else grads[n].clone()
        assert_same_state(a, graphs[how], f"{how}, as copied")
    opts = {k: torch.optim.SGD(trainable(g), lr=0.05) for k, g in graphs.items()}
    for step in range(3):  # lockstep: the same forwards, backwards and steps on every graph
        outs = {k: train_forward(g, task, 10 + step) for k, g in graphs.items()}
        for k in COPIES:
            assert torch.equal(outs[k], outs["original"]), f"{k}: training forward {step}"
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    evals = {}
    for k, g in graphs.items():  # applies the last step's statistics, then observes at once
        g.eval()
        with torch.no_grad():
            evals[k] = output(g(**task.batch(20)))
        g.train()
    for k in COPIES:
        assert torch.equal(evals[k], evals["original"]), f"{k}: evaluation forward"
        assert_same_state(a, graphs[k], f"{k}, after training on")


QAT = ("int8-qat", "8da4w-qat", "w4a8-qat", "lsq", "qlora-nf4", "forward")
POINTS = ("compiled", "forward", "accumulating", "stepped", "frozen")


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("spec_name", QAT)
def test_symbolic_graph(spec_name: str, point: str, pristine: Any, tmp_path: Any) -> None:
    check("cnn", spec_name, point, pristine, tmp_path)


@pytest.mark.parametrize("point", ["compiled", "calibrated"])
def test_static_graph(point: str, pristine: Any, tmp_path: Any) -> None:
    check("cnn", "int8-static", point, pristine, tmp_path)


@pytest.mark.parametrize("point", ["accumulating", "stepped"])
def test_pipeline_graph(point: str, pristine: Any, tmp_path: Any) -> None:
    """Stage children: the quantizers' entries carry the model's names like the rest (what
    torch.distributed.checkpoint resolves)."""
    keys = list(pristine("cnn", "staged").state_dict())
    assert any(k.endswith("._extra_state") for k in keys)
    assert not [k for k in keys if k.startswith("stage_")]
    check("cnn", "staged", point, pristine, tmp_path)


@pytest.mark.parametrize(("task", "spec_name", "point"), [
    *[("llama", "int8-qat", p) for p in POINTS],
    ("llama", "8da4w-qat", "accumulating"),
    ("llama", "lsq", "stepped"),
    ("llama", "qlora-nf4", "stepped"),
    ("llama", "forward", "stepped"),
    ("llama", "int8-static", "calibrated"),
    ("mixtral", "int8-qat", "accumulating"),
    ("mixtral", "int8-qat", "stepped"),
    ("mixtral", "w4a8-qat", "stepped"),
])
def test_exported_hf_graph(task: str, spec_name: str, point: str, pristine: Any,
                           tmp_path: Any) -> None:
    check(task, spec_name, point, pristine, tmp_path)


# -- entries, old state dicts, mistakes ---------------------------------------------------------
def stepped_graph() -> torch.fx.GraphModule:
    gm = compile_graph("cnn", "int8-qat")
    to_point(gm, TASKS["cnn"], "stepped")
    return gm


def test_pending_statistics_are_extra_state_not_buffers() -> None:
    """DDP broadcasts buffers from rank 0 before every forward: a rank's own pending
    statistics must not be one. The entry holds them as they are."""
    gm = stepped_graph()
    name, q = next((n, q) for n, q in qc.quantizers(gm).items() if q.deferred())
    assert not any("_extra_state" in n for n, _ in gm.named_buffers())
    entry = gm.state_dict()[f"{name}._extra_state"]
    mn, mx = q.pending_stats()
    n = mn.numel()
    assert entry.dtype == torch.float32 and entry.shape == (2 + 2 * n,)
    assert entry[0] == float(ready(q))
    assert entry[1] == 2  # an optimizer step came after the forward that gathered them
    assert torch.equal(entry[2:2 + n], mn.reshape(-1)) and torch.equal(entry[2 + n:],
                                                                         mx.reshape(-1))


def test_a_state_dict_without_the_entries_loads_strictly() -> None:
    """A state dict saved before the entries existed: loads under strict=True, dropping
    the pending statistics (what loading did then); the observers' own statistics load."""
    gm = stepped_graph()
    old = {k: v for k, v in gm.state_dict().items() if not k.endswith("._extra_state")}
    fresh = compile_graph("cnn", "int8-qat")
    result = fresh.load_state_dict(old)  # strict
    assert not result.missing_keys and not result.unexpected_keys
    assert all(q.pending_stats() is None for q in qc.quantizers(fresh).values())
    for k in old:
        assert torch.equal(fresh.state_dict()[k], old[k]), k


def test_an_entry_that_does_not_fit_is_a_clear_error() -> None:
    gm = stepped_graph()
    sd = gm.state_dict()
    key = next(k for k, v in sd.items() if k.endswith("._extra_state") and v.numel() > 2)
    sd[key] = torch.zeros(5)
    with pytest.raises(qc.QCompileError, match=key.replace(".", r"\.")):
        compile_graph("cnn", "int8-qat").load_state_dict(sd)


def test_a_wrapped_graph_saves_and_resumes_under_a_process_group(tmp_path: Any) -> None:
    """``qc.distributed.wrap`` (DDP, one gloo rank): the graph still pickles mid-step (its
    sync hook is a module-level function; the group is forgotten), and the loaded graph,
    wrapped again, trains on like the original; so does a DCP copy (a collective here)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        task = TASKS["cnn"]
        s = {**spec("int8-qat"), "data_parallel": {"kind": "ddp"}}
        a = compile_graph("cnn", "int8-qat")
        wrapped = {"original": qc.distributed.wrap(a, s)}
        train_forward(wrapped["original"], task, 1)
        torch.optim.SGD(trainable(a), lr=0.05).step()  # statistics pending, step ended
        b = saved(a, None, None)
        c = checkpoint(a, compile_graph("cnn", "int8-qat"), tmp_path / "dcp")
        for k, g in (("torch.save", b), ("dcp", c)):
            assert_same_state(a, g, f"{k}, as copied")
            wrapped[k] = qc.distributed.wrap(g, s)
        graphs = {"original": a, "torch.save": b, "dcp": c}
        opts = {k: torch.optim.SGD(trainable(g), lr=0.05) for k, g in graphs.items()}
        for step in range(2):
            for opt in opts.values():
                opt.zero_grad()
            outs = {k: train_forward(w, task, 10 + step) for k, w in wrapped.items()}
            for k in ("torch.save", "dcp"):
                assert torch.equal(outs[k], outs["original"]), f"{k}: training forward {step}"
            for opt in opts.values():
                opt.step()
        for k in ("torch.save", "dcp"):
            assert_same_state(a, graphs[k], f"{k}, after training on")
    finally:
        dist.destroy_process_group()
