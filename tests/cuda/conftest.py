"""The CUDA tests (marker ``cuda``): collected by the default run, skipped where torch sees
no CUDA device (``tools/gpu-check`` runs them on a GPU machine).

Every test compares what runs on the device with the CPU reference (the same module or
function on CPU tensors). ``QCOMPILE_CUDA_TESTS_DEVICE=cpu`` runs them with the CPU as
"the device" (gloo instead of NCCL): a dry run of the tests' own code on a machine without
a GPU, where every comparison is CPU against CPU.

Fixtures: ``device`` (the device under test; TF32 off for the test, as the CPU reference
computes fp32 matmuls in full precision), ``backend`` (NCCL on CUDA, gloo on the CPU) and
``world_of_one`` (a process group of world size 1 in this process, on a FileStore in the
test's temporary folder, destroyed afterwards).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

NO_DEVICE = "no CUDA device (QCOMPILE_CUDA_TESTS_DEVICE=cpu dry-runs these tests on the CPU)"


def device_under_test() -> torch.device | None:
    forced = os.environ.get("QCOMPILE_CUDA_TESTS_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda", 0) if torch.cuda.is_available() else None


@pytest.fixture
def device() -> Iterator[torch.device]:
    dev = device_under_test()
    if dev is None:
        pytest.skip(NO_DEVICE)
    if dev.type != "cuda":
        yield dev
        return
    torch.cuda.set_device(dev)
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            yield dev
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


@pytest.fixture(autouse=True)
def _needs_device(request: pytest.FixtureRequest) -> None:
    """Tests marked ``cuda`` skip without a device (those that check the GPU tooling
    itself on the CPU carry no mark)."""
    if request.node.get_closest_marker("cuda") is not None and device_under_test() is None:
        pytest.skip(NO_DEVICE)


@pytest.fixture
def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@pytest.fixture
def world_of_one(device: torch.device, backend: str, tmp_path: Path) -> Iterator[str]:
    """An initialised default process group of world size 1 (this process is rank 0)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is already initialised (a test did not destroy it)")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=(tmp_path / "store").as_uri(), rank=0,
                            world_size=1, **kwargs)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def bit_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` (any device) holds exactly ``want``'s values: the same dtype and
    shape, NaN in the same places, every other element the same bits (the sign of zero
    included); else what differs, with the first few elements."""
    got = got.detach().cpu()
    want = want.detach().cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    if not got.is_floating_point():
        bad = got != want
    else:
        nan_g, nan_w = torch.isnan(got), torch.isnan(want)
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        bad = (nan_g != nan_w) | (~nan_g & ~nan_w & (got.view(ints) != want.view(ints)))
    n = int(bad.sum())
    if n == 0:
        return None
    idx = bad.reshape(-1).nonzero()[:4, 0]
    pairs = [(float(got.reshape(-1)[i]), float(want.reshape(-1)[i])) for i in idx]
    return f"{n} of {got.numel()} elements differ, e.g. (device, cpu) {pairs}"


@pytest.fixture
def same_bits():
    """``same_bits(got, want, what)``: fails with ``bit_difference``'s description."""

    def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        diff = bit_difference(got, want)
        assert diff is None, f"{what}: {diff}"

    return check
