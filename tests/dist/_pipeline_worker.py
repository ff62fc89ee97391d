"""One rank of the 2-process pipeline tests (``test_pipeline.py`` launches two of these).

Run as a script, never imported from the tests folder::

    python tests/dist/_pipeline_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and either ``QC_DIST_INIT`` (an ``init_method`` URL, e.g.
``file:///tmp/x/store``) or torchrun's ``MASTER_ADDR``/``MASTER_PORT`` in the environment,
so ``torchrun --standalone --nproc_per_node=2 tests/dist/_pipeline_worker.py OUT gpipe``
works too when debugging. Most cases run on an int8-qat model with fixed scales (one
forward over the batch, then ``qc.freeze``); the ``live_*`` cases keep the observers live
(QAT as a user runs it). The reference is the unsplit compiled graph
with the same state_dict: per-micro-batch losses of a mean-reduced loss and the gradients of
their mean. Each rank writes ``OUTDIR/rank<r>.json`` (``{case: result}``) after every case;
the test asserts on those. An unexpected exception is recorded (``{"crash": traceback}``)
and the rank exits at once with status 1, so its peer fails on the broken connection (or
the process-group timeout) instead of waiting forever.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _worker_main import cases_in, error_of, run_cases
from torch import nn

import qcompile as qc
from qcompile.distributed.data_parallel import apply_pending

BATCH, MICRO = 8, 4
D, V, T = 16, 11, 5  # features; vocabulary and sequence length of the tied model
PG_TIMEOUT = datetime.timedelta(seconds=30)


# -- models ---------------------------------------------------------------------------------
class Residual(nn.Module):
    """The skip from ``emb`` to before ``head`` crosses any cut in between."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(D, D)
        self.l = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        skip = x
        for layer in self.l:
            x = torch.relu(layer(x))
        return self.head(x + skip)


class GlobalSkip(nn.Module):
    """The model input is added to the model output: the skip spans every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.l:
            h = torch.relu(layer(h))
        return h + x


class TiedHead(nn.Module):
    """Output projection through the embedding's weight (``F.linear(x, emb.weight)``)."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, V))
        self.__dict__["emb"] = emb  # a reference, not a registered child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.emb.weight, self.bias)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)
        self.head = TiedHead(self.emb)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.head(x)


class TiedPost(Tied):
    """``Tied`` plus a layer after the head, so the head need not be on the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.post = nn.Linear(V, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.post(super().forward(tokens))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def token_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def dense_data(batch: int = BATCH, out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, D, generator=torch.Generator().manual_seed(1))
    y = torch.randn(batch, out, generator=torch.Generator().manual_seed(2))
    return x, y


def token_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (BATCH, T), generator=g)
    return tokens, torch.randint(0, V, (BATCH, T), generator=g)


# -- helpers --------------------------------------------------------------------------------
def build(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def compile_pair(cls: type[nn.Module], pipeline: dict[str, Any], x: torch.Tensor
                 ) -> tuple[dict[str, Any], Any, Any]:
    """(spec, pipelined graph, unsplit reference graph): both quantized with fixed scales,
    the reference loaded with the pipelined graph's state_dict."""
    spec = qc.load_spec("int8-qat").model_dump()
    spec["pipeline"] = pipeline
    gm = qc.qcompile(build(cls), spec, example_inputs=(x[:2],))
    with torch.no_grad():
        gm(x)
    qc.freeze(gm)
    ref = qc.qcompile(build(cls), {**spec, "pipeline": None}, example_inputs=(x[:2],))
    with torch.no_grad():
        ref(x)
    qc.freeze(ref)
    ref.load_state_dict(gm.state_dict())
    return spec, gm, ref


def reference(ref: Any, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor
              ) -> list[float]:
    """Per-micro-batch losses; ``ref``'s grads become those of their mean."""
    losses = [loss_fn(ref(xm), ym) for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO))]
    torch.stack(losses).mean().backward()
    return [v.item() for v in losses]


def as_list(stage: Any) -> list[Any]:
    return stage if isinstance(stage, list) else [stage]


def pipeline_step(spec: dict[str, Any], gm: Any, loss_fn: Callable, x: torch.Tensor,
                  y: torch.Tensor, by_name: str | None = None
                  ) -> tuple[list[Any], Any, list[float]]:
    """This rank's stages, the schedule, and the losses (last stage's rank only) of a step;
    ``by_name``: pass the model input as ``step(<by_name>=x)``."""
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=loss_fn)
    stages = as_list(stage)
    losses: list[torch.Tensor] = []
    args: tuple[torch.Tensor, ...] = ()
    inputs: dict[str, torch.Tensor] = {}
    if any(s.is_first for s in stages):
        if by_name:
            inputs[by_name] = x
        else:
            args = (x,)
    if any(s.is_last for s in stages):
        schedule.step(*args, target=y, losses=losses, **inputs)
    else:
        schedule.step(*args, **inputs)
    return stages, schedule, [v.detach().item() for v in losses]


def grad_report(stages: list[Any], ref: Any) -> dict[str, Any]:
    """Each of this rank's stage parameters (original names) against the reference."""
    ref_params = dict(ref.named_parameters())
    out: dict[str, Any] = {"stages": {}, "grad_diff": {}, "no_grad": [], "unknown": []}
    for s in stages:
        names = []
        for name, p in s.submod.named_parameters():
            names.append(name)
            if name not in ref_params:
                out["unknown"].append(name)
            elif p.grad is None:
                out["no_grad"].append(name)
            else:
                diff = (p.grad - ref_params[name].grad).abs().max().item()
                out["grad_diff"][name] = max(diff, out["grad_diff"].get(name, 0.0))
        out["stages"][str(s.stage_index)] = names
    out["ref_params"] = sorted(ref_params)
    return out


def train_case(cls: type[nn.Module], pipeline: dict[str, Any], loss_fn: Callable = mse,
               data: tuple[torch.Tensor, torch.Tensor] | None = None,
               by_name: str | None = None) -> dict[str, Any]:
    x, y = dense_data() if data is None else data
    spec, gm, ref = compile_pair(cls, pipeline, x)
    ref_losses = reference(ref, loss_fn, x, y)
    stages, _, losses = pipeline_step(spec, gm, loss_fn, x, y, by_name)
    return {"losses": losses, "ref_losses": ref_losses, **grad_report(stages, ref)}


# -- cases ----------------------------------------------------------------------------------
def case_gpipe() -> dict[str, Any]:
    return train_case(Residual, {"stages": 2, "microbatches": MICRO, "schedule": "gpipe"})


def case_1f1b() -> dict[str, Any]:
    return train_case(Residual, {"stages": 2, "microbatches": MICRO, "schedule": "1f1b"})


def case_inputs_by_name() -> dict[str, Any]:
    return train_case(Residual, {"stages": 2, "microbatches": MICRO, "schedule": "gpipe"},
                      by_name="x")


def case_global_skip_gpipe() -> dict[str, Any]:
    return train_case(GlobalSkip, {"stages": 2, "microbatches": MICRO, "schedule": "gpipe"},
                      data=dense_data(out=D))


def case_global_skip_1f1b() -> dict[str, Any]:
    return train_case(GlobalSkip, {"stages": 2, "microbatches": MICRO, "schedule": "1f1b"},
                      data=dense_data(out=D))


def case_tied() -> dict[str, Any]:
    pipeline = {"stages": [{"modules": ["emb", "fc1"]}, {"modules": ["fc2", "head"]}],
                "microbatches": MICRO, "schedule": "1f1b"}
    tokens, target = token_data()
    spec, gm, ref = compile_pair(Tied, pipeline, tokens)
    ref_losses = reference(ref, token_ce, tokens, target)
    stages, _, losses = pipeline_step(spec, gm, token_ce, tokens, target)
    out = {"losses": losses, "ref_losses": ref_losses, **grad_report(stages, ref)}
    # who holds the tied weight, and one SGD step on each rank
    (stage,) = stages
    params = dict(stage.submod.named_parameters())
    out["holds_tied"] = "emb.weight" in params
    lr = 0.5
    torch.optim.SGD(stage.submod.parameters(), lr=lr).step()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    mine = params["emb.weight"].detach().clone()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    out["tied_rank_diff"] = max((w - everyone[0]).abs().max().item() for w in everyone)
    out["tied_ref_diff"] = (mine - ref.get_parameter("emb.weight").detach()).abs().max().item()
    return out


def tied_interleaved(stages: list[list[str]]) -> dict[str, Any]:
    pipeline = {"stages": [{"modules": m} for m in stages], "microbatches": MICRO,
                "schedule": "interleaved_1f1b"}
    tokens, target = token_data()
    spec, gm, ref = compile_pair(TiedPost, pipeline, tokens)
    ref_losses = reference(ref, token_ce, tokens, target)
    stages_, _, losses = pipeline_step(spec, gm, token_ce, tokens, target)
    return {"losses": losses, "ref_losses": ref_losses, **grad_report(stages_, ref)}


def case_tied_interleaved_cross_rank() -> dict[str, Any]:
    return tied_interleaved([["emb"], ["fc1"], ["fc2"], ["head", "post"]])


def case_tied_interleaved_same_rank() -> dict[str, Any]:
    return tied_interleaved([["emb"], ["fc1"], ["fc2", "head"], ["post"]])


def live_case(pipeline: dict[str, Any], steps: int = 20) -> dict[str, Any]:
    """Int8 QAT with live observers (never frozen): the first step against the unsplit graph
    run micro-batch by micro-batch (same state_dict, so every quantizer sees the same inputs
    in the same order), then ``steps`` Adam steps of the pipeline."""
    x, y = dense_data()
    spec = qc.load_spec("int8-qat").model_dump()
    spec["pipeline"] = pipeline
    gm = qc.qcompile(build(Residual), spec, example_inputs=(x[:2],))
    ref = qc.qcompile(build(Residual), {**spec, "pipeline": None}, example_inputs=(x[:2],))
    ref.load_state_dict(gm.state_dict())
    ref_losses = reference(ref, mse, x, y)
    # the step's observations (every micro-batch) apply once, as the schedule's step does
    apply_pending(ref, sync=False)
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=mse)
    stages = as_list(stage)
    ref_buffers = dict(ref.named_buffers())
    history: list[list[float]] = []
    out: dict[str, Any] = {"ref_losses": ref_losses}
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.Adam(list({id(p): p for p in params}.values()), lr=3e-3)
    for step in range(steps):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        args = (x,) if any(s.is_first for s in stages) else ()
        if any(s.is_last for s in stages):
            schedule.step(*args, target=y, losses=losses)
        else:
            schedule.step(*args)
        history.append([v.detach().item() for v in losses])
        if step == 0:  # statistics and gradients of the first step against the reference
            out.update(grad_report(stages, ref))
            diff, compared = 0.0, 0
            for s in stages:
                for name, b in s.submod.named_buffers():
                    if name in ref_buffers and b.is_floating_point():
                        d = (b - ref_buffers[name]).abs().nan_to_num(posinf=1e30)
                        diff = max(diff, d.max().item() if d.numel() else 0.0)
                        compared += 1
            out["buffer_diff"], out["buffers_compared"] = diff, compared
        opt.step()
    out["losses"] = history[0]
    out["history"] = [sum(h) / len(h) for h in history if h]
    return out


def case_live_gpipe() -> dict[str, Any]:
    return live_case({"stages": 2, "microbatches": MICRO, "schedule": "gpipe"})


def case_live_1f1b() -> dict[str, Any]:
    return live_case({"stages": 2, "microbatches": MICRO, "schedule": "1f1b"})


def case_live_interleaved() -> dict[str, Any]:
    return live_case({"stages": 4, "microbatches": MICRO, "schedule": "interleaved_1f1b"})


def case_bad_batch() -> dict[str, Any]:
    x, y = dense_data(batch=6)
    spec, gm, _ = compile_pair(Residual, {"stages": 2, "microbatches": MICRO}, x)
    stage, schedule = qc.distributed.pipeline(gm, spec, loss_fn=mse)

    def step() -> None:
        if stage.is_first:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])

    out = error_of(step)
    # nothing was sent: the same schedule still runs a good batch afterwards
    x8, y8 = dense_data()
    losses: list[torch.Tensor] = []
    if stage.is_first:
        schedule.step(x8)
    else:
        schedule.step(target=y8, losses=losses)
    out["then_losses"] = len(losses)
    return out


def case_gpipe_3_stages() -> dict[str, Any]:
    x, _ = dense_data()
    spec, gm, _ = compile_pair(Residual, {"stages": 3, "microbatches": MICRO,
                                          "schedule": "gpipe"}, x)
    return error_of(lambda: qc.distributed.pipeline(gm, spec, loss_fn=mse))


def case_interleaved() -> dict[str, Any]:
    return train_case(Residual, {"stages": 4, "microbatches": MICRO,
                                 "schedule": "interleaved_1f1b"})


CASES = cases_in(globals())


# -- main -----------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    return run_cases(Path(argv[0]), argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
