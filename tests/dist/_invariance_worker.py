"""One rank of the world-size invariance tests (``test_world_size_invariance.py`` launches
two, then four). Run as a script, never imported from the tests folder::

    python tests/dist/_invariance_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and ``QC_DIST_INIT`` (or torchrun's ``MASTER_ADDR`` /
``MASTER_PORT``) in the environment. Each rank writes ``OUTDIR/rank<r>.json``
(``{case: result}``) after every case; the test asserts on those.

Data: step ``s`` has a global batch of ``GLOBAL`` rows drawn from a generator seeded by
``s``, so every rank can rebuild all of it. The rows are scaled by their position, so each
slice of the batch (a rank's, a micro-batch's) has a range of its own: an observer that
sees only its slice before the statistics are combined gives other qparams. With ``W``
ranks, rank ``r`` trains on rows ``[r * GLOBAL / W, (r + 1) * GLOBAL / W)``.

Reference: every rank also trains the same model in this process on the whole global batch
(loss = mean over it, what DDP's and FSDP2's gradient averaging computes), compiled with
``data_parallel: none`` and ``sync_observers: false``: its step statistics are applied
locally (at the forward after each optimizer step), and the final
``qc.distributed.sync_observers`` runs over a group of this rank alone, so nothing of
another rank reaches it.
"""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _worker_main import cases_in, run_cases
from torch import nn

import qcompile as qc

D_IN, WIDTH, D_OUT, BLOCKS = 8, 16, 4, 2
GLOBAL = 16
STEPS = 10
LR = 0.05
PG_TIMEOUT = datetime.timedelta(seconds=30)
OUTDIR = Path(".")


# -- model and data -------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm residual MLP block: LayerNorm (per row: no statistic across the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.ln(x)))


class Model(nn.Module):
    """An input Linear, ``BLOCKS`` residual blocks (the FSDP2 units of ``compile_once``),
    a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D_IN, WIDTH)
        self.layers = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL, D_IN, generator=g)
    # the rows' scale grows with their position: every slice has a range of its own
    x *= torch.linspace(0.5, 3.0, GLOBAL).unsqueeze(1)
    y = torch.randn(GLOBAL, D_OUT, generator=g)
    return x, y


def local(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    n = GLOBAL // world
    return t[rank * n:(rank + 1) * n]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# -- specs ----------------------------------------------------------------------------------
def qat_spec(kind: str, update: str = "step") -> dict[str, Any]:
    """int8 QAT: the blocks' Linears with min-max activation observers, the other Linears
    and the residual adds with moving averages (momentum 0.1, so that ten steps move them)."""
    weight = {"dtype": "int8", "symmetric": True, "granularity": "per_channel",
              "observer": "minmax"}

    def act(observer: Any) -> dict[str, Any]:
        return {"dtype": "uint8", "symmetric": False, "observer": observer}

    moving = {"kind": "moving_average", "momentum": 0.1}
    return {
        "version": 1,
        "quant": {"mode": "qat", "target": "x86", "observer_update": update,
                  "rules": [
                      {"match": {"module": "Linear", "name": "layers.*"},
                       "weight": weight, "activation": act("minmax")},
                      {"match": {"module": "Linear"}, "weight": weight,
                       "activation": act(moving)},
                      {"match": {"op": "add"}, "activation": act(moving)}]},
        "data_parallel": {"kind": kind},
    }


def float_spec(kind: str) -> dict[str, Any]:
    return {"version": 1, "quant": {"mode": "none"}, "data_parallel": {"kind": kind}}


def reference_spec(spec: dict[str, Any]) -> dict[str, Any]:
    quant = {**spec["quant"]}
    if quant["mode"] != "none":
        quant["sync_observers"] = False
    return {**spec, "quant": quant, "data_parallel": {"kind": "none"}}


def example() -> tuple[torch.Tensor]:
    return (torch.randn(2, D_IN),)


# -- comparing ------------------------------------------------------------------------------
def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def model_name(name: str) -> str:
    """The model's own name: ``compile_once``'s sharded graph holds each FSDP2 unit in a
    child ``stage_<i>``."""
    return re.sub(r"^stage_\d+\.", "", name)


def state(gm: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, and every quantizer's scale, zero point and observer statistics."""
    out = {f"param:{model_name(n)}": full(p) for n, p in gm.named_parameters()}
    for name, q in qc.quantizers(gm).items():
        name = model_name(name)
        out[f"scale:{name}"] = full(q.scale)
        out[f"zero_point:{name}"] = full(q.zero_point)
        if q.observer is not None:
            out[f"min:{name}"] = full(q.observer.min_val)
            out[f"max:{name}"] = full(q.observer.max_val)
    return out


def diffs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Largest absolute difference per name (equal infinities, an observer that saw
    nothing, count as equal); names on one side only are listed."""
    d = {}
    for k in sorted(set(got) & set(want)):
        a, b = got[k].double(), want[k].double()
        if a.shape != b.shape:
            d[k] = float("inf")
            continue
        same_inf = torch.isinf(a) & (a == b)
        d[k] = float((a - b).abs().masked_fill(same_inf, 0.0).max()) if a.numel() else 0.0
    return {"diff": d, "only_got": sorted(set(got) - set(want)),
            "only_want": sorted(set(want) - set(got))}


# -- training -------------------------------------------------------------------------------
def build(spec: dict[str, Any], how: str) -> Any:
    if how == "compile_once":
        return qc.distributed.compile_once(Model, spec, example())
    if how == "alone":
        spec = reference_spec(spec)
    return qc.qcompile(Model(), spec, example_inputs=example())


def step_of(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor,
            accumulate: int) -> None:
    if accumulate > 1:
        qc.distributed.train_step(model, opt, x, y, mse, accumulate=accumulate)
        return
    opt.zero_grad()
    mse(model(x), y).backward()
    opt.step()


class ObserverLog:
    """The per-step minimum and maximum of what each activation quantizer of a graph is
    given (forward pre-hooks on the quantizers), and what its observer should hold after
    one update per step: the running min / max, or the moving average (first value as
    is, then ``old + (new - old) * momentum`` in float32, the observer's formula); and
    which quantizers returned their input unchanged in each of the first two forwards."""

    def __init__(self, gm: nn.Module) -> None:
        self.seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.unchanged: list[list[str]] = [[], []]
        self.calls: dict[str, int] = {}
        self.quantizers = {n: q for n, q in qc.quantizers(gm).items()
                           if q.observer is not None and not n.endswith("weight_fake_quant")}
        for name, q in self.quantizers.items():
            self.seen[name] = []
            self.calls[name] = 0
            q.register_forward_pre_hook(self._hook(name))
            q.register_forward_hook(self._out_hook(name))

    def _hook(self, name: str) -> Any:
        def record(module: nn.Module, args: Any) -> None:
            x = args[0].detach().float()
            self.seen[name].append((x.min().reshape(1), x.max().reshape(1)))
        return record

    def _out_hook(self, name: str) -> Any:
        def record(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            call = self.calls[name]
            self.calls[name] += 1
            if call < 2 and torch.equal(out, args[0]):
                self.unchanged[call].append(name)
        return record

    def check(self) -> dict[str, Any]:
        out = {}
        for name, q in self.quantizers.items():
            values = self.seen[name]
            momentum = getattr(q.observer, "momentum", None)
            mn, mx = values[0]
            for new_mn, new_mx in values[1:]:
                if momentum is None:
                    mn, mx = torch.minimum(mn, new_mn), torch.maximum(mx, new_mx)
                else:
                    mn = mn + (new_mn - mn) * momentum
                    mx = mx + (new_mx - mx) * momentum
            got = torch.cat([q.observer.min_val, q.observer.max_val]).double()
            want = torch.cat([mn, mx]).double()
            out[name] = {"observer": type(q.observer).__name__, "updates": len(values),
                         "diff": float((got - want).abs().max())}
        return out


def uninitialised(gm: nn.Module) -> list[str]:
    """Quantizers whose observer holds no statistics or whose scale is still the unit
    scale of a new quantizer."""
    return sorted(model_name(n) for n, q in qc.quantizers(gm).items()
                  if q.observer is not None and (
                      not bool(torch.isfinite(q.observer.min_val).all())
                      or bool((full(q.scale) == 1.0).all())))


def train(spec: dict[str, Any], how: str = "wrap", accumulate: int = 1, group: Any = None,
          steps: int = STEPS) -> dict[str, Any]:
    """``steps`` SGD steps of the graph ``how`` builds, against the reference: one
    process, the whole global batch in one forward per step.

    ``how``: ``wrap`` (``qcompile``, then ``qc.distributed.wrap`` over ``group``, each rank
    on its slice of the global batch), ``compile_once`` (``qc.distributed.compile_once``,
    then ``wrap``) or ``alone`` (a second single-process graph on the whole batch: only
    ``accumulate`` differs from the reference). ``accumulate`` > 1: every step through
    ``qc.distributed.train_step`` in that many micro-batches. Both graphs sync their
    observers at the end, so the last step's statistics are applied."""
    gm = build(spec, how)
    alone = how == "alone"
    model = gm if alone else qc.distributed.wrap(gm, spec, group)
    ref = qc.qcompile(Model(), reference_spec(spec), example_inputs=example())
    log = ObserverLog(ref)
    start = state(ref)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(steps):
        x, y = global_batch(step)
        if alone:
            step_of(model, opt, x, y, accumulate)
        else:
            step_of(model, opt, local(x, group), local(y, group), accumulate)
        step_of(ref, ref_opt, x, y, 1)
    # the graph's last step applied across its group, the reference's over this rank alone
    own, _ = dist.new_subgroups(group_size=1)
    qc.distributed.sync_observers(gm, own if alone else group)
    qc.distributed.sync_observers(ref, own)
    got, want = state(gm), state(ref)
    out = diffs(got, want)
    out["moved"] = {k: v for k, v in diffs(want, start)["diff"].items()
                    if k.startswith("param:")}
    out["uninitialised"] = {"graph": uninitialised(gm), "reference": uninitialised(ref)}
    out["observer_check"] = log.check()
    out["unchanged"] = {"first": sorted(log.unchanged[0]), "second": sorted(log.unchanged[1]),
                        "activation_quantizers": sorted(log.quantizers)}
    out["world"] = 1 if alone else dist.get_world_size(group)
    return out


# -- cases ----------------------------------------------------------------------------------
def case_float_ddp() -> dict[str, Any]:
    return train(float_spec("ddp"))


def case_float_fsdp2() -> dict[str, Any]:
    return train(float_spec("fsdp2"))


def case_ddp_step() -> dict[str, Any]:
    return train(qat_spec("ddp"))


def case_ddp_step_w1() -> dict[str, Any]:
    """DDP over a group of one rank (each rank its own), the whole batch."""
    own, _ = dist.new_subgroups(group_size=1)
    return train(qat_spec("ddp"), group=own)


def case_fsdp2_step() -> dict[str, Any]:
    return train(qat_spec("fsdp2"))


def case_compile_once_step() -> dict[str, Any]:
    return train(qat_spec("fsdp2"), how="compile_once")


def case_accumulate_step() -> dict[str, Any]:
    """k micro-batches against one batch k times their size: alone (4 x 4 rows), under DDP
    and under FSDP2 (2 x 4 rows per rank)."""
    return {"alone": train(qat_spec("ddp"), how="alone", accumulate=4),
            "ddp": train(qat_spec("ddp"), accumulate=2),
            "fsdp2": train(qat_spec("fsdp2"), accumulate=2)}


def case_ddp_forward() -> dict[str, Any]:
    return train(qat_spec("ddp", update="forward"))


def case_accumulate_forward() -> dict[str, Any]:
    return train(qat_spec("ddp", update="forward"), how="alone", accumulate=4)


OBSERVER_KINDS = ("minmax", "moving_average", "histogram", "percentile", "mse")


def kind_spec(kind: str, mode: str) -> dict[str, Any]:
    """Every activation quantizer (the Linears' outputs and the adds) with observer
    ``kind``; weights per-channel min-max; DDP."""
    act = {"dtype": "uint8", "symmetric": False, "observer": kind}
    weight = {"dtype": "int8", "granularity": "per_channel", "observer": "minmax"}
    return {"version": 1, "data_parallel": {"kind": "ddp"},
            "quant": {"mode": mode, "target": "x86", "sync_observers": True, "rules": [
                {"match": {"module": "Linear"}, "weight": weight, "activation": act},
                {"match": {"op": "add"}, "activation": act}]}}


def calibrated(kind: str) -> dict[str, Any]:
    """``qc.calibrate`` on 3 global batches: each rank on its slice (statistics reduced
    across the ranks), against one process on the whole batches."""
    spec = kind_spec(kind, "static")
    batches = [global_batch(s)[0] for s in range(3)]
    gm = qc.qcompile(Model(), spec, example_inputs=example())
    qc.calibrate(gm, [(local(x),) for x in batches], progress=False)
    ref = qc.qcompile(Model(), reference_spec(spec), example_inputs=example())
    qc.calibrate(ref, [(x,) for x in batches], sync=False, progress=False)
    out = diffs(state(gm), state(ref))
    out["uninitialised"] = {"graph": uninitialised(gm), "reference": uninitialised(ref)}
    out["observers"] = sorted({type(q.observer).__name__ for q in qc.quantizers(gm).values()
                               if q.observer is not None})
    return out


def case_observer_kinds() -> dict[str, Any]:
    """For each observer kind: calibration on 2 ranks and 4 QAT steps under DDP (each
    rank on its slice), against one process on the global batches."""
    return {kind: {"calibrate": calibrated(kind), "qat": train(kind_spec(kind, "qat"), steps=4)}
            for kind in OBSERVER_KINDS}


class CountAllReduce:
    """Counts Python-level ``all_reduce`` calls and their bytes while active (DDP's
    gradient buckets go through its C++ reducer, not through this function)."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def __enter__(self) -> CountAllReduce:
        self.saved = dist.all_reduce

        def shim(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return self.saved(tensor, *args, **kwargs)

        dist.all_reduce = shim
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self.saved


def case_sync_bytes() -> dict[str, Any]:
    """What one optimizer step sends for the observers under DDP: ``sync_observers``
    after a hand-written step, and every ``all_reduce`` during a ``train_step`` (2
    micro-batches). Only activation statistics should travel."""
    spec = qat_spec("ddp")
    gm = build(spec, "wrap")
    model = qc.distributed.wrap(gm, spec)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    elements = {"activation": 0, "weight": 0}
    for name, q in qc.quantizers(gm).items():
        if q.observer is not None:
            role = "weight" if name.endswith("weight_fake_quant") else "activation"
            elements[role] += q.observer.min_val.numel() + q.observer.max_val.numel()
    x, y = global_batch(0)
    step_of(model, opt, local(x), local(y), 1)
    returned = qc.distributed.sync_observers(gm)
    again = qc.distributed.sync_observers(gm)
    x, y = global_batch(1)
    with CountAllReduce() as counted:
        step_of(model, opt, local(x), local(y), 2)
    after = qc.distributed.sync_observers(gm)
    return {"elements": elements, "returned": returned, "again": again,
            "train_step": {"calls": counted.calls, "bytes": counted.bytes},
            "after_train_step": after}


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
