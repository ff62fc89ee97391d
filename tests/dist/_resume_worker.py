"""One rank of the resume tests (``test_resume.py``).

Run as a script, never imported from the tests folder::

    python tests/dist/_resume_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and ``QC_DIST_INIT`` in the environment. Each case trains a
tiny Llama two steps under a layout, saves the model and optimizer with
torch.distributed.checkpoint (``get_model_state_dict`` and
``qc.distributed.optimizer_state_dict``), loads them into a freshly compiled and wrapped
copy (``dcp.load``, then torch's ``set_state_dict``), and trains both two more steps on the
same batches. Each rank writes ``OUTDIR/rank<r>.json`` after every case.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import transformers
from _tensor_parallel_worker import lm_batch, lm_loss
from _worker_main import cases_in, run_cases
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_state_dict,
)

import qcompile as qc

PG_TIMEOUT = datetime.timedelta(seconds=60)
OUTDIR = Path(".")


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        tie_word_embeddings=False))


def whole(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def resume(preset: str, layout: dict[str, Any], name: str, flatten: bool = False
           ) -> dict[str, Any]:
    d = {**qc.load_spec(preset).model_dump(), **layout}
    batch = lm_batch(2)

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = qc.distributed.wrap(qc.qcompile(llama(), d, example_kwargs=batch), d)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        loss = lm_loss(model(**batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        qc.distributed.sync_observers(model)  # pending statistics applied before saving
        return loss.item()

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": get_model_state_dict(model, options=options),
                "optim": qc.distributed.optimizer_state_dict(model, opt, options=options)}

    model, opt = make()
    for _ in range(2):
        step(model, opt)
    saved = state(model, opt)
    torch_keys = list(get_optimizer_state_dict(model, opt, options=options)
                      .get("state", {}))[:3]
    path = str(OUTDIR / name)
    dcp.save(saved, checkpoint_id=path)
    again, opt2 = make()
    loaded = state(again, opt2)
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(again, opt2, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"], options=options)
    first = [step(model, opt) for _ in range(2)]
    second = [step(again, opt2) for _ in range(2)]
    a, b = model.state_dict(), again.state_dict()
    optim_keys = list(saved["optim"]["state"]) if not flatten else [
        k for k in saved["optim"] if k.startswith("state.")]
    return {"losses": first, "resumed_losses": second,
            "state_equal": a.keys() == b.keys() and all(
                torch.equal(whole(a[k]), whole(b[k])) for k in a),
            "optim_keys": optim_keys[:3], "torch_keys": torch_keys,
            "model_keys": list(saved["model"])[:3]}


def case_fsdp2() -> dict[str, Any]:
    return resume("int8-qat", {"data_parallel": {"kind": "fsdp2"}}, "fsdp2")


def case_fsdp2_flat() -> dict[str, Any]:
    return resume("int8-qat", {"data_parallel": {"kind": "fsdp2"}}, "fsdp2_flat",
                  flatten=True)


def case_tp() -> dict[str, Any]:
    return resume("8da4w-qat", {"tensor_parallel": {"size": 2, "plan": "auto"}}, "tp")


def case_dp_tp() -> dict[str, Any]:
    return resume("8da4w-qat", {"data_parallel": {"kind": "fsdp2"},
                                "tensor_parallel": {"size": 2, "plan": "auto"}}, "dp_tp")


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    global OUTDIR
    OUTDIR = Path(argv[0])
    return run_cases(OUTDIR, argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
