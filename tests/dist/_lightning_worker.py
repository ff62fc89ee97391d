"""One rank of the 2-process Lightning test (``test_lightning.py`` launches two; run as a
script, never imported)::

    python tests/dist/_lightning_worker.py OUTDIR CASE [CASE ...]

with ``RANK``, ``WORLD_SIZE`` and ``QC_DIST_INIT`` set. The recipe is the code of
``docs/how-to/lightning.md`` itself (its ``python no-run`` block, executed here): the page
cannot drift from what is tested. The process group is joined before Lightning starts
(``LOCAL_RANK`` set: Lightning takes the processes as launched for it and keeps the group).
Each rank writes ``OUTDIR/rank<r>.json`` (``{case: result}``) after every case.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch
from _worker_main import cases_in, run_cases

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "how-to" / "lightning.md"
PARSER = ROOT / "tests" / "docs" / "test_code_blocks.py"
PG_TIMEOUT = datetime.timedelta(seconds=60)
STEPS = 6
TRAINER = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
           "enable_model_summary": False}


def recipe() -> types.ModuleType:
    """The page's recipe as a module (classes defined there must be importable by name)."""
    spec = importlib.util.spec_from_file_location("qc_docs_parser", PARSER)
    parser = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = parser
    spec.loader.exec_module(parser)
    code = [b for b in parser.blocks(PAGE.read_text(encoding="utf-8"))
            if b.lang == "python" and "class QuantizedRegressor" in b.code]
    assert len(code) == 1, f"{PAGE} has {len(code)} recipe blocks"
    module = types.ModuleType("lightning_recipe")
    sys.modules[module.__name__] = module
    exec(compile("\n" * (code[0].line - 1) + code[0].code, str(PAGE), "exec"), module.__dict__)
    return module


def state(gm: torch.nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().double().reshape(-1).tolist() for k, v in gm.state_dict().items()
            if isinstance(v, torch.Tensor) and v.is_floating_point()}


def train(synced: bool) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = os.environ["RANK"]  # one node: Lightning launches nothing
    page = recipe()
    model = page.QuantizedRegressor()
    if not synced:  # the recipe less its one qcompile call
        model.setup = lambda stage: None
    before = state(model.gm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        page.fit(model, max_steps=STEPS, **TRAINER)
    return {"before": before, "after": state(model.gm), "steps": model.global_step,
            "observing": [q.observe for q in model.gm.modules()
                          if type(q).__name__ == "FakeQuantize"],
            "warnings": sorted({str(w.message)[:300] for w in caught
                                if "synchronises" in str(w.message)})}


def case_synced() -> dict[str, Any]:
    return train(synced=True)


def case_unsynced() -> dict[str, Any]:
    return train(synced=False)


CASES = cases_in(globals())


def main(argv: list[str]) -> int:
    return run_cases(Path(argv[0]), argv[1:], CASES, PG_TIMEOUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
