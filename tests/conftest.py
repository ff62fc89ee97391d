"""Shared test settings: hypothesis profiles and golden-file helpers.

Profiles: ``ci`` (derandomized, the default under CI=true or tools/test) and ``dev``
(random, more examples). Pick one with ``HYPOTHESIS_PROFILE=dev``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

# Shared test helpers (tests/helpers/*.py) import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Two cores: keep intra-op threads fixed so runs are comparable and reproducible.
torch.set_num_threads(min(2, torch.get_num_threads()))

# Inductor's FX graph cache key leaves out ATEN_CPU_CAPABILITY: with torch 2.13, a graph
# compiled by a default run and served from the cache to an ATEN_CPU_CAPABILITY=avx2 run
# on the same machine computes garbage. A run that forces an instruction set keeps its
# own cache (workers and subprocesses inherit it).
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        default_cache_dir(), "aten-" + os.environ["ATEN_CPU_CAPABILITY"])


# -- golden files ---------------------------------------------------------------------
import pytest  # noqa: E402


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """``golden(name, text)``: compare ``text`` with ``golden/<name>.txt`` beside the test
    file. ``QCOMPILE_UPDATE_GOLDEN=1`` (re)writes the file instead; review the diff."""
    folder = Path(request.path).parent / "golden"

    def check(name: str, text: str) -> None:
        path = folder / f"{name}.txt"
        text = text.rstrip("\n") + "\n"
        if os.environ.get("QCOMPILE_UPDATE_GOLDEN") == "1":
            folder.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        assert path.exists(), f"no golden file {path}; run with QCOMPILE_UPDATE_GOLDEN=1"
        expected = path.read_text(encoding="utf-8")
        assert text == expected, f"graph differs from {path} (QCOMPILE_UPDATE_GOLDEN=1 rewrites)"

    return check


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on tensors of a few hundred elements a second
    OpenMP thread only adds its synchronisation (tens of times the run time on a busy
    2-core machine). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- file modes -------------------------------------------------------------------------
@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request: pytest.FixtureRequest):
    """Run the test under this umask (the process's; restored after): what qcompile writes
    must get ``0o666 & ~umask`` (files) and ``0o777 & ~umask`` (folders)."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


# -- end-to-end runs kept out of the default suite ---------------------------------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``e2e`` (a tool's whole quick run, tens of seconds, process groups
    included) skip unless ``QCOMPILE_E2E=1``: ``.ci/run`` runs them once after the default
    suite, which keeps inside its time budget."""
    if os.environ.get("QCOMPILE_E2E") == "1":
        return
    skip = pytest.mark.skip(reason="an end-to-end run: .ci/run runs it (QCOMPILE_E2E=1)")
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(skip)
