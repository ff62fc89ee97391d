"""``tools/demo --spec <preset>`` runs to its summary for every bundled preset (a tiny
workload: one epoch on 64 digits): static presets calibrate instead of fine-tuning, LoRA
adapters are merged before converting, and a graph ``qc.export_onnx`` refuses (block
formats: onnxruntime has no kernel for them) ends with the reason the export was skipped,
not with an error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from qcompile.tools.quickstart import main

pytestmark = pytest.mark.usefixtures("one_thread")

PRESETS = sorted((Path(__file__).resolve().parents[2] / "specs" / "presets").glob("*.yaml"))
# block-scaled element formats (OCP MX, NVFP4, NF4): no ONNX element type onnxruntime runs
BLOCK_FORMATS = {"mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4",
                 "nf4"}
HAS_ONNX = all(importlib.util.find_spec(m) is not None
               for m in ("onnx", "onnxscript", "onnxruntime"))


def formats(preset: Path) -> set[str]:
    """The element formats the preset's rules name (read from its YAML)."""
    rules = yaml.safe_load(preset.read_text())["quant"]["rules"]
    return {rule[role]["dtype"] for rule in rules for role in ("weight", "activation")
            if isinstance(rule.get(role), dict) and "dtype" in rule[role]}


def test_every_preset_is_swept() -> None:
    assert len(PRESETS) >= 10 and {"int8-static", "mxfp4-qat", "qlora-nf4"} <= {
        p.stem for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_demo_ends_with_its_summary(preset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if preset.stem == "gguf-q4_k-qat":  # 256-element super-blocks: the demo's MLP is 64 wide
        assert main(["--spec", preset.stem, "--epochs", "1", "--finetune", "1",
                     "--samples", "64"]) == 1
        out, err = capsys.readouterr()
        assert "q8_k blocks of 256 do not divide 64" in out + err
        return
    assert main(["--spec", preset.stem, "--epochs", "1", "--finetune", "1",
                 "--samples", "64"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "error:" not in err, err
    lines = out.strip().splitlines()
    assert lines[-1].startswith("test accuracy: fp32 "), lines[-1]
    if preset.stem.startswith("gguf-"):  # llama.cpp's grids leave through qc.export_gguf
        assert any(line.startswith("not converted: ") for line in lines)
        assert "qc.export_gguf" in out and " converted " not in lines[-1]
        return
    assert " converted " in lines[-1], lines[-1]
    mode = yaml.safe_load(preset.read_text())["quant"]["mode"]
    if mode == "static":
        assert any(line.startswith("calibrated on 64 digits") for line in lines)
        assert " PTQ " in lines[-1]
    else:
        assert any(line.startswith("fine-tuned 1 epochs") for line in lines)
    onnx = "\n".join(line for line in lines if "ONNX" in line)
    block = formats(preset) & BLOCK_FORMATS
    if not HAS_ONNX:
        assert "ONNX export skipped: pip install qcompile[onnx]" in onnx
    elif block:
        assert onnx.startswith("ONNX export skipped, onnxruntime cannot run this graph: ")
        assert any(f in onnx for f in block), onnx  # the reason names the format
        assert "onnxruntime" not in lines[-1]  # no accuracy to show
    else:
        assert onnx.startswith("exported to ONNX"), onnx
        assert " onnxruntime " in lines[-1]
