"""The deployment writers (``save_adapters``, ``export_encodings``, ``export_onnx``) write
whole files or none: an interrupted or killed write leaves the previous files and nothing
the next write does not remove (safetensors' and ONNX's own temporaries included), and
every file gets the mode the umask gives a new file (safetensors alone gives 0600)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from killed_writer import kill_mid_write
from safetensors.torch import load_file
from torch import nn

import qcompile as qc

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
ADAPTERS = {"adapters": [{"match": {"module": "Linear"}, "rank": 2}]}
# what the child builds: the same tiny graph, its adapters set from a seed
BUILD = """
    import torch, qcompile as qc
    def build(seed):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        gm = qc.qcompile(m, {"adapters": [{"match": {"module": "Linear"}, "rank": 2}]})
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in gm.named_parameters():
                if "lora_" in name:
                    p.normal_()
        return gm
    """


def build(seed: int) -> nn.Module:
    scope: dict = {}
    exec(BUILD.replace("\n    ", "\n"), scope)
    return scope["build"](seed)


def modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}


@pytest.fixture(scope="module")
def calibrated() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    gm = qc.qcompile(m, "int8-static", example_inputs=(X,))
    qc.calibrate(gm, [X], progress=False)
    return gm.eval()


# -- save_adapters ----------------------------------------------------------------------------
def test_adapters_get_the_umask_mode(tmp_path: Path, umask: int) -> None:
    qc.save_adapters(build(1), tmp_path)
    want = {0o022: 0o644, 0o077: 0o600}[umask]
    assert modes(tmp_path) == {"adapter_model.safetensors": want, "adapter_config.json": want}


def test_a_killed_save_adapters_leaves_the_previous_adapter(tmp_path: Path) -> None:
    """Killed inside the weights' write (safetensors has written and renamed its own
    temporary, nothing is moved yet): the previous pair is intact, and what the killed
    writer left is one temporary folder, which the next save removes."""
    qc.save_adapters(build(1), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    kill_mid_write(BUILD + f"""
    import safetensors.torch
    real = safetensors.torch.save_file
    def save_then_block(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        block()
    safetensors.torch.save_file = save_then_block
    qc.save_adapters(build(2), {str(tmp_path)!r})
    """, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before} == before
    (left,) = (p for p in tmp_path.iterdir() if p.name not in before)
    assert left.is_dir() and (left / "adapter_model.safetensors").is_file()
    qc.save_adapters(build(2), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)
    ours = build(2).state_dict()
    saved = load_file(tmp_path / "adapter_model.safetensors")
    key = next(k for k in saved if "lora_A" in k)
    assert any(torch.equal(saved[key], v) for k, v in ours.items() if "lora_A" in k)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 2


# -- export_encodings -------------------------------------------------------------------------
def test_an_interrupted_export_encodings_leaves_the_previous_file(
        tmp_path: Path, calibrated: nn.Module, umask: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.encodings"
    qc.export_encodings(calibrated, path)
    assert modes(tmp_path) == {"m.encodings": {0o022: 0o644, 0o077: 0o600}[umask]}
    before = path.read_bytes()

    def torn(self: Path, data: str, *args, **kwargs) -> int:
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise KeyboardInterrupt  # Ctrl-C half-way through

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(KeyboardInterrupt):
        qc.export_encodings(calibrated, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


# -- export_onnx ------------------------------------------------------------------------------
def test_onnx_modes_and_an_interrupted_external_data_export(
        tmp_path: Path, calibrated: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with ``.data`` beside it (the hard case: ir.save writes the data through a
    temporary of its own): both files get the umask's mode, none of ir.save's temporaries
    stays; an export interrupted after the data was written leaves both previous files."""
    onnx = pytest.importorskip("onnx")
    path = tmp_path / "m.onnx"
    monkeypatch.setattr("qcompile.deploy.onnx._EXTERNAL_DATA_BYTES", 0)
    old = os.umask(0o022)
    try:
        qc.export_onnx(calibrated, path, example_inputs=(X,))
    finally:
        os.umask(old)
    assert modes(tmp_path) == {"m.onnx": 0o644, "m.onnx.data": 0o644}
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = onnx.save

    def interrupted(proto, f, *args, **kwargs):  # the data is written; the model half-way
        real(proto, f, *args, **kwargs)
        Path(f).write_bytes(Path(f).read_bytes()[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        qc.export_onnx(calibrated, path, example_inputs=(X,))
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    onnx.checker.check_model(str(path))  # the previous model and its data still load


# -- export_gguf ------------------------------------------------------------------------------
GGUF_BUILD = """
    import torch, transformers, qcompile as qc
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    gm = qc.qcompile(transformers.LlamaForCausalLM(cfg), "gguf-q4_0-qat",
                     example_kwargs={"input_ids": torch.randint(0, 64, (1, 8))})
"""


def test_a_killed_export_gguf_leaves_no_file(tmp_path: Path) -> None:
    """Killed with half the tensors written: nothing at the path (a half GGUF would load
    in llama.cpp as a broken model); the next export to the path writes it whole, with the
    umask's mode, and the dead writer's temporary is gone."""
    umask = os.umask(0o022)
    os.umask(umask)
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    path = tmp_path / "model.gguf"
    kill_mid_write(GGUF_BUILD + f"""
    import gguf
    def half_then_block(self, *args, **kwargs):
        self.fout[0].write(b"\\0" * 4096)  # some of the tensor data
        self.fout[0].flush()
        block()
    gguf.GGUFWriter.write_tensors_to_file = half_then_block
    qc.export_gguf(gm, {str(path)!r}, config=cfg)
    """, tmp_path)
    assert not path.exists()
    scope: dict = {}
    exec(GGUF_BUILD.replace("\n    ", "\n"), scope)
    qc.export_gguf(scope["gm"], path, config=scope["cfg"])
    assert modes(tmp_path) == {"model.gguf": 0o666 & ~umask}
    import gguf

    assert len(gguf.GGUFReader(path).tensors) > 0
