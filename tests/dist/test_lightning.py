"""The Lightning recipe (``docs/how-to/lightning.md``) under ``strategy="ddp"`` on 2 ranks
(gloo, CPU): a compiled graph held in a ``LightningModule``, wrapped in DDP by Lightning,
its observers kept in sync by ``keep_observers_in_sync`` in ``setup()``.

One launch runs two cases with the page's own code (``_lightning_worker.py``): the recipe,
and the recipe with ``setup()`` doing nothing (the control: the same training, observers
left to each rank). Lightning gives each rank its own batches. Skipped without
``lightning``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

# find_spec, not importorskip: importing Lightning here would cost this process seconds
pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="needs lightning (pip install lightning)")]

WORKER = Path(__file__).with_name("_lightning_worker.py")
LAUNCH_DEADLINE = 150.0  # both cases together (about 25 s on 2 idle cores)
ACTIVATION = (".scale", ".zero_point", ".observer.min_val", ".observer.max_val")


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory: pytest.TempPathFactory, dist_launcher: Any) -> Any:
    return dist_launcher(WORKER, ["synced", "unsynced"], tmp_path_factory.mktemp("lightning"),
                         LAUNCH_DEADLINE)


def _quantizer_state(state: dict[str, list[float]]) -> dict[str, list[float]]:
    return {k: v for k, v in state.items() if "fake_quant" in k and k.endswith(ACTIVATION)}


def _activation_scales(state: dict[str, list[float]]) -> dict[str, list[float]]:
    return {k: v for k, v in state.items()
            if k.endswith(".scale") and "weight_fake_quant" not in k}


def test_ranks_end_with_identical_weights_and_qparams(dist_run: Any) -> None:
    r0, r1 = dist_run.case("synced")
    assert r0["steps"] == r1["steps"] == 6
    assert r0["after"].keys() == r1["after"].keys()
    quantizers = _quantizer_state(r0["after"])
    assert any(k.endswith(".weight") for k in r0["after"])
    assert _activation_scales(r0["after"]), "no activation quantizer in the graph"
    differing = sorted(k for k in r0["after"] if r0["after"][k] != r1["after"][k])
    assert not differing, f"tensors differing between the ranks after training: {differing}"
    assert len(quantizers) >= 4
    # not vacuous: training moved the activation qparams, and observers were on until freeze
    moved = [k for k, v in _activation_scales(r0["after"]).items() if v != r0["before"][k]]
    assert moved, "no activation scale changed during training"
    assert not any(r0["observing"]) and not any(r1["observing"]), "fit() froze the graph"
    assert r0["warnings"] == r1["warnings"] == []


def test_without_sync_the_ranks_scales_differ(dist_run: Any) -> None:
    """The control: what the recipe's ``keep_observers_in_sync`` call prevents."""
    r0, r1 = dist_run.case("unsynced")
    scales0, scales1 = _activation_scales(r0["after"]), _activation_scales(r1["after"])
    assert any(scales0[k] != scales1[k] for k in scales0), (
        "the ranks' activation scales agree without synchronisation: the synced case "
        "proves nothing")
    weights = [k for k in r0["after"] if k.endswith(".weight")]
    assert all(r0["after"][k] == r1["after"][k] for k in weights)  # DDP's part holds
    assert any("nothing synchronises them" in w for w in r0["warnings"])
