"""The compile cache and ``qc.distributed.compile_once`` in one process (DESIGN.md,
"Quantize once"; issue 5, item 5 "Compile cache").

An entry is keyed by SHA-256 over graph code, spec JSON, parameter/buffer bytes,
calibration data and the torch + qcompile versions; it holds a manifest and a
tensors-only ``state.pt`` (loaded with ``weights_only=True``), is written atomically, and
a missing, truncated or tampered entry is detected, reported and recompiled, never
trusted. The main case is int8-static with calibration batches: skipping calibration is
what the cache is for.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import qcompile as qc
import qcompile.distributed.cache
import qcompile.distributed.once
from qcompile.distributed.cache import CompileCache, cache_key

SPEC = "int8-static"
MANIFEST = "manifest.json"
STATE = "state.pt"


# -- models and data ----------------------------------------------------------------------
class Net(nn.Module):
    """Two Linear layers, a ReLU and a residual add (so both preset rules match)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)
        self.skip = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))) + self.skip(x)


class DeeperNet(Net):
    """Same parameters as ``Net`` (same names, shapes and values), different structure."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))) + torch.relu(self.skip(x))


class BNNet(nn.Module):
    """Has buffers (BatchNorm running stats) for the key's buffer sensitivity."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class OffsetNet(nn.Module):
    """A plain tensor attribute (not a registered buffer) used in forward: torch.fx turns
    it into a buffer of the compiled graph, so it is part of the cached state."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.offset = torch.full((4,), offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.offset


def build(cls: type[nn.Module] = Net, tweak: Callable[[nn.Module], None] | None = None
          ) -> Callable[[], nn.Module]:
    """A deterministic ``build_model`` for compile_once (seeded weights, optional edit)."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = cls()
        if tweak is not None:
            with torch.no_grad():
                tweak(model)
        return model

    return make


def one_ulp_up(t: torch.Tensor, index: int = 3) -> None:
    """Change exactly one element of ``t`` by the smallest possible amount."""
    flat = t.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf")))


def calibration_batches(n: int = 4, seed: int = 1) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(3 * torch.randn(6, 8, generator=gen),) for _ in range(n)]


X = (torch.randn(5, 8, generator=torch.Generator().manual_seed(2)),)


def with_cache_dir(spec: str, directory: Path | str | None) -> qc.CompileSpec:
    data = qc.load_spec(spec).model_dump()
    data["cache_dir"] = None if directory is None else str(directory)
    return qc.CompileSpec.model_validate(data)


def changed_spec() -> qc.CompileSpec:
    """int8-static with symmetric activations: a different spec that still calibrates."""
    data = qc.load_spec(SPEC).model_dump()
    for rule in data["quant"]["rules"]:
        rule["activation"]["symmetric"] = True
        rule["activation"]["dtype"] = "int8"
    return qc.CompileSpec.model_validate(data)


# -- helpers ------------------------------------------------------------------------------
def compile_cached(directory: Path | None, make: Callable[[], nn.Module] | None = None,
                   spec: Any = SPEC, calibration: Any = "default") -> nn.Module:
    make = make or build()
    if isinstance(calibration, str):
        calibration = calibration_batches()
    return qc.distributed.compile_once(make, spec, X, calibration=calibration,
                                       cache_dir=None if directory is None else str(directory))


def fresh(make: Callable[[], nn.Module] | None = None, spec: Any = SPEC,
          calibration: Any = "default") -> nn.Module:
    """The same compile with no cache anywhere: what every cached result must equal."""
    gm = compile_cached(None, make, spec, calibration)
    assert cache_note(gm) == "compile cache: no cache_dir"
    return gm


def cache_note(gm: nn.Module) -> str:
    notes = [n for p in qc.report(gm).passes for n in p.notes
             if n.startswith("compile cache:")]
    assert len(notes) == 1, notes
    return notes[0]


def outputs(gm: nn.Module) -> torch.Tensor:
    with torch.no_grad():  # on a copy: a forward with observers on would change gm
        return copy.deepcopy(gm)(*X)


def assert_identical(a: nn.Module, b: nn.Module) -> None:
    """Bit-identical state (every parameter and buffer), quantizer flags and outputs."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k], sb[k]), f"{k} differs"
    qa, qb = qc.quantizers(a), qc.quantizers(b)
    assert list(qa) == list(qb) and qa
    for name in qa:
        assert (qa[name].enabled, qa[name].observe) == (qb[name].enabled, qb[name].observe), name
    assert a.training == b.training
    assert torch.equal(outputs(a), outputs(b))


def entries(directory: Path) -> list[str]:
    """Entry folders (temporary folders start with a dot)."""
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def only_entry(directory: Path) -> Path:
    names = entries(directory)
    assert len(names) == 1, names
    return directory / names[0]


@pytest.fixture
def calibrations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records every calibration compile_once runs (the number of batches each time).

    Why a spy on ``collect_statistics`` in ``qcompile.distributed.once``: compile_once
    hashes the calibration batches into the key, so it iterates them on a hit too — a batch
    iterator that records being read cannot tell a hit from a miss. compile_once calls the
    name it imported into its own module, so replacing that attribute intercepts exactly
    the calibration step; the spy delegates to the real function, so results are
    unchanged. Tests using it also assert that a miss records one call, which proves the
    spy is wired in (a spy that never fires would make "no call on a hit" vacuous).
    """
    calls: list[int] = []
    real = qcompile.distributed.once.collect_statistics

    def spy(gm: nn.Module, batches: Any, **kwargs: Any) -> nn.Module:
        batches = list(batches)
        calls.append(len(batches))
        return real(gm, batches, **kwargs)

    monkeypatch.setattr(qcompile.distributed.once, "collect_statistics", spy)
    return calls


# -- hit ----------------------------------------------------------------------------------
def test_second_compile_hits_without_calibrating(tmp_path: Path, calibrations: list[int]
                                                 ) -> None:
    batches = calibration_batches()
    # A one-shot generator on the first call: compile_once must read it once for both the
    # key and the calibration; the second call passes a list with the same tensors.
    first = compile_cached(tmp_path, calibration=(b for b in batches))
    assert cache_note(first) == "compile cache: miss"
    assert calibrations == [len(batches)]
    entry = only_entry(tmp_path)

    second = compile_cached(tmp_path, calibration=batches)
    assert cache_note(second) == "compile cache: hit"
    assert calibrations == [len(batches)], "a hit must not calibrate again"
    assert entries(tmp_path) == [entry.name]
    assert_identical(first, second)
    # the cached graph is calibrated: fake-quant on, observers frozen
    assert all(q.enabled and not q.observe for q in qc.quantizers(second).values())
    assert_identical(second, fresh())


def test_hit_for_qat_without_calibration(tmp_path: Path, calibrations: list[int]) -> None:
    first = compile_cached(tmp_path, spec="int8-qat", calibration=None)
    second = compile_cached(tmp_path, spec="int8-qat", calibration=None)
    assert (cache_note(first), cache_note(second)) == ("compile cache: miss",
                                                       "compile cache: hit")
    assert calibrations == []
    assert all(q.enabled and q.observe for q in qc.quantizers(second).values())
    assert_identical(first, second)


def test_cache_dir_from_the_spec(tmp_path: Path) -> None:
    directory = tmp_path / "from-spec"
    spec = with_cache_dir(SPEC, directory)
    first = compile_cached(None, spec=spec)
    second = compile_cached(None, spec=spec)
    assert (cache_note(first), cache_note(second)) == ("compile cache: miss",
                                                       "compile cache: hit")
    assert len(entries(directory)) == 1
    assert_identical(first, second)


def test_no_cache_dir_touches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    monkeypatch.chdir(tmp_path)
    gm = compile_cached(None)
    assert cache_note(gm) == "compile cache: no cache_dir"
    assert list(tmp_path.iterdir()) == []


def test_entry_layout_and_manifest(tmp_path: Path) -> None:
    gm = compile_cached(tmp_path)
    entry = only_entry(tmp_path)
    assert sorted(p.name for p in entry.iterdir()) == [MANIFEST, STATE]
    assert len(entry.name) == 64 and int(entry.name, 16) >= 0
    manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
    assert manifest["key"] == entry.name
    assert manifest["qcompile"] == qc.__version__
    assert manifest["torch"] == torch.__version__
    digest = hashlib.sha256((entry / STATE).read_bytes()).hexdigest()
    assert manifest["files"] == {STATE: digest}
    assert manifest["report"]["mode"] == "static"
    # what compile + calibrate produced, never the weights (the model provides them)
    weights = {n for n, _ in Net().named_parameters()}
    assert set(torch.load(entry / STATE, weights_only=True)) == set(gm.state_dict()) - weights


# -- misses -------------------------------------------------------------------------------
def _other_batches() -> list[tuple[torch.Tensor]]:
    """One element changed, to a value outside the other data's range (so it reaches the
    observers' min/max)."""
    batches = calibration_batches()
    batches[2][0].view(-1)[5] = 100.0
    return batches


VARIANTS: dict[str, dict[str, Any]] = {
    "spec": {"spec": changed_spec()},
    "weights": {"make": build(tweak=lambda m: one_ulp_up(m.fc1.weight.data))},
    "calibration": {"calibration": _other_batches()},
    "structure": {"make": build(DeeperNet)},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_miss_on_any_change(tmp_path: Path, variant: str, calibrations: list[int]) -> None:
    changes = VARIANTS[variant]
    base = compile_cached(tmp_path)
    base_key = only_entry(tmp_path).name

    other = compile_cached(tmp_path, **changes)
    assert cache_note(other) == "compile cache: miss"
    assert len(calibrations) == 2, "a miss calibrates"
    keys = entries(tmp_path)
    assert len(keys) == 2 and base_key in keys, "a new entry beside the old one"
    # the miss really recompiled: equal to a cache-free compile of the variant
    assert_identical(other, fresh(**changes))
    # both entries stay usable
    calibrated = len(calibrations)
    again_base = compile_cached(tmp_path)
    again_other = compile_cached(tmp_path, **changes)
    assert cache_note(again_base) == cache_note(again_other) == "compile cache: hit"
    assert len(calibrations) == calibrated
    assert_identical(again_base, base)
    assert_identical(again_other, other)


def test_different_calibration_gives_different_qparams() -> None:
    """Guards the calibration variant above: the data change reaches the qparams, so a
    stale hit there would be observable, not just a different key."""
    a, b = fresh(), fresh(calibration=_other_batches())
    qa, qb = qc.quantizers(a), qc.quantizers(b)
    assert any(not torch.equal(qa[n].observer.min_val, qb[n].observer.min_val)
               or not torch.equal(qa[n].observer.max_val, qb[n].observer.max_val)
               for n in qa if qa[n].observer is not None)


def test_plain_tensor_attribute_change_misses(tmp_path: Path) -> None:
    compile_cached(tmp_path, make=lambda: _offset_net(0.0))
    assert "offset" in qc.qcompile(_offset_net(0.0), SPEC, X).state_dict()
    changed = compile_cached(tmp_path, make=lambda: _offset_net(100.0))
    assert cache_note(changed) == "compile cache: miss"
    assert_identical(changed, fresh(make=lambda: _offset_net(100.0)))


def _offset_net(offset: float) -> nn.Module:
    torch.manual_seed(0)
    return OffsetNet(offset)


# -- corrupted entries --------------------------------------------------------------------
def _truncate(entry: Path) -> None:
    data = (entry / STATE).read_bytes()
    (entry / STATE).write_bytes(data[: len(data) // 2])


TAMPERED = "fc1.weight_fake_quant.scale"  # per-channel: 16 float32 values


def _tamper_tensor(entry: Path) -> None:
    """Flip one byte inside a stored scale's bytes: still a loadable file whose tensor
    silently holds a different value, so only the hash can tell."""
    path = entry / STATE
    before = torch.load(path, weights_only=True)
    data = bytearray(path.read_bytes())
    stored = before[TAMPERED].contiguous().numpy().tobytes()
    at = bytes(data).find(stored)
    assert at >= 0, f"{TAMPERED}'s bytes are stored uncompressed"
    data[at + 7] ^= 0x01
    path.write_bytes(bytes(data))
    after = torch.load(path, weights_only=True)
    assert not torch.equal(before[TAMPERED], after[TAMPERED])
    assert all(torch.equal(before[k], after[k]) for k in before if k != TAMPERED)


def _edit_manifest(entry: Path, **changes: Any) -> None:
    manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
    manifest.update(changes)
    (entry / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


def _make_entry_a_file(entry: Path) -> None:
    shutil.rmtree(entry)
    entry.write_bytes(b"not an entry")


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "truncated state": (_truncate, ("fails its hash check",)),
    "tampered tensor": (_tamper_tensor, ("fails its hash check",)),
    "manifest hash edited": (
        lambda e: _edit_manifest(e, files={STATE: hashlib.sha256(b"x").hexdigest()}),
        ("fails its hash check",)),
    "manifest deleted": (lambda e: (e / MANIFEST).unlink(),
                         ("unreadable entry", "FileNotFoundError")),
    "state deleted": (lambda e: (e / STATE).unlink(), ("unreadable entry", "FileNotFoundError")),
    "garbage json": (lambda e: (e / MANIFEST).write_text("{not json", encoding="utf-8"),
                     ("unreadable entry", "JSONDecodeError")),
    "manifest for another key": (lambda e: _edit_manifest(e, key="0" * 64),
                                 ("manifest does not match the key",)),
    "manifest is JSON null": (lambda e: (e / MANIFEST).write_text("null", encoding="utf-8"),
                              ()),
    "manifest files is null": (lambda e: _edit_manifest(e, files=None), ()),
    "entry is a file": (_make_entry_a_file, ("unreadable entry",)),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupted_entry_is_reported_recompiled_and_rewritten(
        tmp_path: Path, corruption: str, calibrations: list[int]) -> None:
    corrupt, expected = CORRUPTIONS[corruption]
    first = compile_cached(tmp_path)
    entry = only_entry(tmp_path)
    corrupt(entry)
    _, why = CompileCache(tmp_path).load(entry.name)
    assert why != "hit"

    second = compile_cached(tmp_path)
    note = cache_note(second)
    assert note != "compile cache: hit"
    assert note == f"compile cache: {why}"
    for words in expected:
        assert words in note, note
    assert len(calibrations) == 2, "a broken entry is recompiled and recalibrated"
    assert_identical(second, first)
    assert_identical(second, fresh())

    # rewritten: valid again, and the next call hits
    assert entries(tmp_path) == [entry.name] and entry.is_dir()
    assert CompileCache(tmp_path).load(entry.name)[1] == "hit"
    third = compile_cached(tmp_path)
    assert cache_note(third) == "compile cache: hit"
    assert len(calibrations) == 3, "only fresh() calibrated since the recompile"
    assert_identical(third, first)


# -- no pickled code ----------------------------------------------------------------------
class _Payload:
    """Unpickling this creates ``path`` (a stand-in for arbitrary code execution)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _forge_manifest(entry: Path) -> None:
    """What an attacker who can write the folder does: make the hash match again."""
    _edit_manifest(entry, files={STATE: hashlib.sha256((entry / STATE).read_bytes()).hexdigest()})


def test_state_is_plain_tensors_loadable_weights_only(tmp_path: Path) -> None:
    gm = compile_cached(tmp_path)
    entry = only_entry(tmp_path)
    state = torch.load(entry / STATE, weights_only=True)
    weights = {n for n, _ in Net().named_parameters()}
    assert isinstance(state, dict) and list(state) == [k for k in gm.state_dict()
                                                       if k not in weights]
    assert all(type(v) is torch.Tensor for v in state.values())
    assert all(torch.equal(v, gm.state_dict()[k]) for k, v in state.items())
    raw = (entry / STATE).read_bytes()
    assert b"GraphModule" not in raw and b"qcompile" not in raw
    # nothing in the entry needs unpickling but state.pt, and the manifest is JSON
    json.loads((entry / MANIFEST).read_text(encoding="utf-8"))


PAYLOADS: dict[str, Callable[[Path], Any]] = {
    "object()": lambda marker: {"x": object()},
    "__reduce__ payload": lambda marker: {"x": _Payload(marker)},
}


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("forged_manifest", [False, True], ids=["hash kept", "hash forged"])
def test_pickled_objects_are_refused_and_run_no_code(
        tmp_path: Path, payload: str, forged_manifest: bool) -> None:
    # The payload is armed: unpickling it the unsafe way does create its marker.
    armed = tmp_path / "armed-marker"
    probe = io.BytesIO()
    torch.save(PAYLOADS[payload](armed), probe)
    probe.seek(0)
    torch.load(probe, weights_only=False)
    assert armed.exists() == (payload == "__reduce__ payload")

    cache_dir = tmp_path / "cache"
    marker = tmp_path / "marker"
    compile_cached(cache_dir)
    entry = only_entry(cache_dir)
    torch.save(PAYLOADS[payload](marker), entry / STATE)
    if forged_manifest:
        _forge_manifest(entry)
    try:
        state, why = CompileCache(cache_dir).load(entry.name)
    except Exception as e:  # refusing by raising still must not run the payload
        state, why = None, f"raised {type(e).__name__}"
    assert state is None and why != "hit"
    assert not marker.exists(), "unpickling ran code from the cache"


def test_pickled_object_with_forged_manifest_is_recompiled(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    cache_dir = tmp_path / "cache"
    compile_cached(cache_dir)
    entry = only_entry(cache_dir)
    torch.save({"x": _Payload(marker)}, entry / STATE)
    _forge_manifest(entry)
    try:
        gm = compile_cached(cache_dir)
    finally:
        assert not marker.exists()
    assert cache_note(gm) != "compile cache: hit"
    assert_identical(gm, fresh())
    assert cache_note(compile_cached(cache_dir)) == "compile cache: hit"


@pytest.mark.parametrize("edit", ["drop", "extra", "reshape", "retype"])
def test_entry_that_does_not_fit_the_graph_is_rebuilt(tmp_path: Path, edit: str) -> None:
    """A well-formed entry (hash recomputed) whose tensors do not fit the graph is a miss
    that says why, is rebuilt and rewritten, not an error on every call."""
    compile_cached(tmp_path)
    entry = only_entry(tmp_path)
    state = torch.load(entry / STATE, weights_only=True)
    name = next(k for k in state if k.endswith("weight_fake_quant.scale"))
    if edit == "drop":
        del state[name]
    elif edit == "extra":
        state["stray.tensor"] = torch.zeros(2)
    elif edit == "reshape":
        state[name] = torch.zeros(3, 3)
    else:
        state[name] = state[name].double()
    torch.save(state, entry / STATE)
    _forge_manifest(entry)
    gm = compile_cached(tmp_path)
    note = cache_note(gm)
    assert "does not fit the graph" in note and "rebuilt" in note, note
    assert (name in note) or ("stray.tensor" in note), note
    assert_identical(gm, fresh())
    assert cache_note(compile_cached(tmp_path)) == "compile cache: hit"


# -- atomic writes ------------------------------------------------------------------------
def _crash_in_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    real_save = torch.save

    def partial_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 3])
        raise RuntimeError("simulated crash while writing state.pt")

    monkeypatch.setattr(qcompile.distributed.cache.torch, "save", partial_save)


def _crash_in_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(src: Any, dst: Any) -> None:
        raise RuntimeError("simulated crash before the rename")

    monkeypatch.setattr(qcompile.distributed.cache.os, "replace", crash)


@pytest.mark.parametrize("crash", [_crash_in_torch_save, _crash_in_rename],
                         ids=["during torch.save", "before rename"])
def test_crash_during_store_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           crash: Callable[[pytest.MonkeyPatch], None]
                                           ) -> None:
    gm = fresh()
    key = "a" * 64
    cache = CompileCache(tmp_path / "cache")
    crash(monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        cache.store(key, gm)
    monkeypatch.undo()
    assert not (tmp_path / "cache" / key).exists()
    assert list((tmp_path / "cache").iterdir()) == [], "no temporary folder left behind"
    assert cache.load(key) == (None, "miss")

    cache.store(key, gm)
    state, why = cache.load(key)
    assert why == "hit" and state is not None
    assert all(torch.equal(state[k], v) for k, v in gm.state_dict().items())
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [key]


def test_crash_during_compile_once_store_then_recovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _crash_in_torch_save(monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        compile_cached(tmp_path)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    first = compile_cached(tmp_path)
    assert cache_note(first) == "compile cache: miss"
    second = compile_cached(tmp_path)
    assert cache_note(second) == "compile cache: hit"
    assert_identical(first, second)


# -- concurrency --------------------------------------------------------------------------
def _run_threads(targets: list[Callable[[], None]]) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # reported to the main thread below
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_concurrent_writers_of_one_key_leave_one_valid_entry(tmp_path: Path) -> None:
    gm = fresh()
    expected = gm.state_dict()
    report_json = qc.report(gm).model_dump_json()
    cache = CompileCache(tmp_path)
    writers, rounds = 4, 8
    bad_reads: list[str] = []

    for r in range(rounds):
        key = f"{r:064x}"
        barrier = threading.Barrier(writers + 1)

        def write(key: str = key, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            CompileCache(tmp_path).store(key, gm, report_json)

        def read(key: str = key, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            for _ in range(20):  # a reader may see no entry, never a wrong one
                state, why = CompileCache(tmp_path).load(key)
                if why == "hit" and not all(torch.equal(state[k], v)
                                            for k, v in expected.items()):
                    bad_reads.append(key)

        errors = _run_threads([write] * writers + [read])
        assert errors == []
        state, why = cache.load(key)
        assert why == "hit"
        assert list(state) == list(expected)
        assert all(torch.equal(state[k], v) for k, v in expected.items())
    assert bad_reads == []
    assert entries(tmp_path) == [f"{r:064x}" for r in range(rounds)]
    assert sorted(p.name for p in tmp_path.iterdir()) == entries(tmp_path), "temp left"


# -- the key ------------------------------------------------------------------------------
@pytest.fixture
def key_inputs() -> Iterator[tuple[str, str, nn.Module, list[tuple[torch.Tensor]]]]:
    model = build(BNNet)()
    gm = qc.qcompile(model, SPEC, X)
    yield gm.code, qc.load_spec(SPEC).model_dump_json(), model, calibration_batches()


def test_cache_key_is_stable(key_inputs: tuple[Any, ...]) -> None:
    code, spec_json, model, batches = key_inputs
    key = cache_key(code, spec_json, model, batches)
    assert len(key) == 64 and int(key, 16) >= 0
    assert cache_key(code, spec_json, model, batches) == key
    assert cache_key(code, spec_json, copy.deepcopy(model), [tuple(t.clone() for t in b)
                                                             for b in batches]) == key
    assert cache_key(code, spec_json, build(BNNet)(), iter(batches)) == key
    # graph code and spec JSON from a second, independent compile
    again = qc.qcompile(build(BNNet)(), SPEC, X)
    assert cache_key(again.code, qc.load_spec(SPEC).model_dump_json(), model, batches) == key


def test_cache_key_changes_with_versions(key_inputs: tuple[Any, ...],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    key = cache_key(*key_inputs)
    monkeypatch.setattr(qcompile.distributed.cache, "__version__", "999.0.0")
    new_qcompile = cache_key(*key_inputs)
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1+test")
    new_torch = cache_key(*key_inputs)
    monkeypatch.undo()
    assert len({key, new_qcompile, new_torch}) == 3
    assert cache_key(*key_inputs) == key


def test_version_change_misses_in_compile_once(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    compile_cached(tmp_path)
    monkeypatch.setattr(qcompile.distributed.cache, "__version__", "999.0.0")
    gm = compile_cached(tmp_path)
    assert cache_note(gm) == "compile cache: miss"
    assert len(entries(tmp_path)) == 2


def _bump_buffer(model: nn.Module) -> None:
    with torch.no_grad():
        one_ulp_up(model.bn.running_mean, index=0)


def _bump_weight(model: nn.Module) -> None:
    with torch.no_grad():
        one_ulp_up(model.fc.weight.data, index=10)


def test_cache_key_covers_each_input(key_inputs: tuple[Any, ...]) -> None:
    code, spec_json, model, batches = key_inputs
    key = cache_key(code, spec_json, model, batches)

    def with_model(edit: Callable[[nn.Module], None]) -> str:
        m = copy.deepcopy(model)
        edit(m)
        return cache_key(code, spec_json, m, batches)

    zeros = [(torch.zeros(2, 8),)]
    variants = {
        "graph code": cache_key(code + "\n", spec_json, model, batches),
        "spec": cache_key(code, changed_spec().model_dump_json(), model, batches),
        "weight": with_model(_bump_weight),
        "buffer": with_model(_bump_buffer),
        "calibration value": cache_key(code, spec_json, model, _other_batches()),
        "calibration dropped": cache_key(code, spec_json, model, None),
        "calibration batch added": cache_key(code, spec_json, model,
                                             [*batches, batches[0]]),
        "zeros": cache_key(code, spec_json, model, zeros),
        "zeros, other dtype (same bytes)": cache_key(
            code, spec_json, model, [(torch.zeros(2, 8, dtype=torch.int32),)]),
        "zeros, other shape (same bytes)": cache_key(code, spec_json, model,
                                                     [(torch.zeros(4, 4),)]),
    }
    assert key not in variants.values()
    assert len(set(variants.values())) == len(variants), variants


# -- errors and notes ---------------------------------------------------------------------
@pytest.mark.parametrize("where", ["under a regular file", "is a regular file"])
def test_unwritable_cache_dir_is_a_user_error(tmp_path: Path, where: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    directory = blocker / "cache" if where == "under a regular file" else blocker
    with pytest.raises(qc.QCompileError, match="cache_dir") as info:
        compile_cached(directory)
    assert str(directory) in info.value.message
    assert info.value.fix and "cache_dir" in info.value.fix
    assert blocker.read_text() == "a file, not a folder"
    with pytest.raises(qc.QCompileError, match="cache_dir"):
        CompileCache(directory).store("b" * 64, fresh())


def test_qcompile_notes_that_compile_once_uses_the_cache(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    gm = qc.qcompile(build()(), with_cache_dir(SPEC, directory), X)
    notes = [n for p in qc.report(gm).passes for n in p.notes]
    assert any("cache_dir" in n and "compile_once" in n for n in notes), notes
    assert not directory.exists(), "qc.qcompile itself neither reads nor writes the cache"
    plain = qc.qcompile(build()(), SPEC, X)
    assert not any("compile_once" in n for p in qc.report(plain).passes for n in p.notes)
