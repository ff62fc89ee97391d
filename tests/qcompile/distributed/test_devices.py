"""Collectives on the backend's device (issue 13, item 7), checked on CPU by backend name:
NCCL gets the rank's CUDA device, gloo (and any CPU-capable backend) the CPU; the
collectives of ``sync_observers`` and ``compile_once`` stage their tensors there."""

from __future__ import annotations

import pytest
import torch

import qcompile.distributed.devices as devices
from qcompile.distributed.devices import collective_device, device_for_backend, staged


@pytest.mark.parametrize(("backend", "want"), [
    ("gloo", torch.device("cpu")),
    ("GLOO", torch.device("cpu")),
    ("mpi", torch.device("cpu")),
    ("ucc", torch.device("cpu")),
    ("something-new", torch.device("cpu")),
    ("nccl", torch.device("cuda", 3)),
    ("cuda:nccl", torch.device("cuda", 3)),
    ("cpu:gloo,cuda:nccl", torch.device("cpu")),  # a CPU-capable backend: no copy
    ("xccl", torch.device("xpu", 3)),
])
def test_device_for_backend(backend: str, want: torch.device) -> None:
    assert device_for_backend(backend, current=3) == want


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A pretend machine with ``count`` GPUs whose current device is ``current``."""
    state = {"count": 4, "current": 0}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return state


def test_nccl_uses_the_current_cuda_device(cuda: dict[str, int]) -> None:
    cuda["current"] = 2  # torch.cuda.set_device(2), as the examples do
    assert device_for_backend("nccl") == torch.device("cuda", 2)


def test_nccl_without_set_device_uses_local_rank(cuda: dict[str, int],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device_for_backend("nccl") == torch.device("cuda", 1)
    cuda["current"] = 3  # set_device wins over LOCAL_RANK
    assert device_for_backend("nccl") == torch.device("cuda", 3)
    cuda.update(count=1, current=0)  # one visible GPU per process (CUDA_VISIBLE_DEVICES)
    assert device_for_backend("nccl") == torch.device("cuda", 0)


def test_collective_device_asks_the_group(cuda: dict[str, int],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    dist = torch.distributed
    assert collective_device() == torch.device("cpu")  # no process group
    backend = {"name": "nccl"}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["name"])

    class Group:
        bound_device_id = None

    cuda["current"] = 1
    assert collective_device(Group()) == torch.device("cuda", 1)
    Group.bound_device_id = torch.device("cuda", 5)  # init_process_group(device_id=...)
    assert collective_device(Group()) == torch.device("cuda", 5)
    backend["name"] = "gloo"
    assert collective_device(Group()) == torch.device("cpu")


def test_staged_copies_only_across_devices() -> None:
    t = torch.ones(3)
    assert staged(t, torch.device("cpu")) is t
    meta = staged(t, torch.device("meta"))
    assert meta is not t and meta.device.type == "meta"


def test_sync_observers_stages_on_the_collective_device(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The flattened statistics go to ``collective_device`` (here 'meta' stands in for a
    GPU: a device the observers are not on) and the reduced values come back."""
    import qcompile as qc
    import qcompile.distributed.data_parallel as dp

    gm = qc.qcompile(torch.nn.Linear(4, 4), "int8-qat", (torch.randn(2, 4),))
    with torch.no_grad():  # observed at once: the per-forward reduction
        gm(torch.randn(2, 4))
    seen: list[torch.device] = []

    def all_reduce(t: torch.Tensor, op: object = None, group: object = None) -> None:
        seen.append(t.device)

    monkeypatch.setattr(dp, "initialised", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(dp, "collective_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(torch.Tensor, "copy_", _copy_from_meta(torch.Tensor.copy_))
    stats = dp.sync_observers(gm)
    assert stats["collectives"] >= 2 and seen and all(d.type == "meta" for d in seen)
    assert all(q.observer.min_val.device.type == "cpu" for q in qc.quantizers(gm).values())


def _copy_from_meta(copy_):
    """``copy_`` that ignores meta sources (meta tensors hold no values to copy back)."""
    def patched(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
        if src.device.type == "meta" and self.device.type != "meta":
            return self
        return copy_(self, src, non_blocking)
    return patched


def test_module_has_no_process_group_side_effects() -> None:
    assert devices.collective_device() == torch.device("cpu")
    assert not torch.distributed.is_initialized()
