"""export_encodings / load_encodings round trip, and the per-layer SQNR report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import qcompile as qc

X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
BATCHES = [(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(s)),)
           for s in range(1, 4)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.conv(x))
        return self.fc((y + y).flatten(1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net().eval()


def calibrated(spec: str = "int8-static") -> torch.fx.GraphModule:
    gm = qc.qcompile(model(), spec, (X,))
    return qc.calibrate(gm, BATCHES)


def test_export_lists_every_quantizer_with_its_numerics(tmp_path: Path) -> None:
    gm = calibrated()
    path = tmp_path / "net.encodings"
    qc.export_encodings(gm, path)
    data = json.loads(path.read_text())
    assert data["version"] == "1.0.0" and data["producer"].startswith("qcompile")
    assert sorted(data["param_encodings"]) == ["conv.weight", "fc.weight"]
    # x_input: the presets quantize a float model input a quantized layer reads
    assert sorted(data["activation_encodings"]) == ["add", "conv.output", "fc.output",
                                                    "x_input"]
    conv = data["param_encodings"]["conv.weight"]
    assert len(conv) == 4  # per channel: one entry per output channel
    fq = qc.quantizers(gm)["conv.weight_fake_quant"]
    for e, s, z in zip(conv, fq.scale.tolist(), fq.zero_point.tolist()):
        assert e["bitwidth"] == 8 and e["dtype"] == "int" and e["is_symmetric"] is True
        assert e["scale"] == s and e["zero_point"] == z and e["offset"] == -z
        assert e["min"] == (e["quant_min"] - z) * s and e["max"] == (e["quant_max"] - z) * s
        assert e["granularity"] == "per_channel" and e["axis"] == 0
    act = data["activation_encodings"]["fc.output"][0]
    assert act["is_symmetric"] is False and act["quant_min"] == 0 and act["quant_max"] == 127
    assert act["bitwidth"] == 7  # quant.target x86: 7-bit activations, the grid AIMET needs


def test_round_trip_reproduces_qparams_and_outputs(tmp_path: Path) -> None:
    a = calibrated()
    path = tmp_path / "a.encodings"
    qc.export_encodings(a, path)
    b = qc.qcompile(model(), "int8-static", (X,))  # fresh: never calibrated
    qc.load_encodings(b, path)
    for name, fq in qc.quantizers(a).items():
        other = qc.quantizers(b)[name]
        assert torch.equal(fq.scale, other.scale) and torch.equal(fq.zero_point,
                                                                  other.zero_point)
        assert other.enabled and not other.observe
    assert torch.equal(a(X), b(X))


def test_stage_children_are_keyed_by_the_model_names(tmp_path: Path) -> None:
    """A graph placed in pipeline stages (a ``stage_<i>`` child graph each) writes the file
    of the model compiled whole (no stage prefix, weights as params), and loads it back."""
    staged = qc.qcompile(model(), {**qc.load_spec("int8-static").model_dump(),
                                   "pipeline": {"stages": 2, "devices": ["cpu", "cpu"]}},
                         (X,))
    assert [n for n, _ in staged.named_children() if n.startswith("stage_")] == [
        "stage_0", "stage_1"]
    qc.calibrate(staged, BATCHES)
    whole = qc.qcompile(model(), "int8-static", (X,))
    whole.load_state_dict(staged.state_dict())
    qc.export_encodings(staged, tmp_path / "staged.json")
    qc.export_encodings(whole, tmp_path / "whole.json")
    staged_data = json.loads((tmp_path / "staged.json").read_text())
    assert staged_data == json.loads((tmp_path / "whole.json").read_text())
    assert sorted(staged_data["param_encodings"]) == ["conv.weight", "fc.weight"]
    fresh = qc.qcompile(model(), {**qc.load_spec("int8-static").model_dump(),
                                  "pipeline": {"stages": 2, "devices": ["cpu", "cpu"]}}, (X,))
    qc.load_encodings(fresh, tmp_path / "whole.json")
    torch.testing.assert_close(fresh(X), staged(X), rtol=0, atol=0)


def test_encodings_of_another_graph_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.encodings"
    qc.export_encodings(calibrated(), path)
    other = qc.qcompile(nn.Sequential(nn.Linear(4, 4)), "int8-static", (torch.randn(2, 4),))
    with pytest.raises(qc.QCompileError, match="different graph"):
        qc.load_encodings(other, path)
    data = json.loads(path.read_text())
    data["param_encodings"]["conv.weight"] = data["param_encodings"]["conv.weight"][:2]
    path.write_text(json.dumps(data))
    with pytest.raises(qc.QCompileError, match=r"conv\.weight'\] \(quantizer "
                       r"conv\.weight_fake_quant\): 2 entries, the quantizer has 4 scale"):
        qc.load_encodings(qc.qcompile(model(), "int8-static", (X,)), path)
    path.write_text("{not json")
    with pytest.raises(qc.QCompileError, match="encodings file"):
        qc.load_encodings(qc.qcompile(model(), "int8-static", (X,)), path)


def test_dynamic_quantizers_are_marked_dynamic(tmp_path: Path) -> None:
    gm = qc.qcompile(nn.Sequential(nn.Linear(8, 4)), "int8-dynamic", (torch.randn(2, 8),))
    path = tmp_path / "d.encodings"
    qc.export_encodings(gm, path)
    data = json.loads(path.read_text())
    assert data["activation_encodings"]["0.input"] == [  # dynamic: what the op reads
        {"dynamic": True, "bitwidth": 7, "is_symmetric": False, "granularity": "per_tensor"}]
    assert len(data["param_encodings"]["0.weight"]) == 4
    qc.load_encodings(gm, path)  # dynamic entries are left as they are


def test_sqnr_reports_every_quantized_activation_worst_first() -> None:
    gm = calibrated()
    qc.freeze(gm)
    gm.eval()
    rows = qc.sqnr(gm, model(), BATCHES)
    # fc re-expressed as `linear`; x: the model input, quantized where conv reads it
    assert {r["node"] for r in rows} == {"relu", "add", "fc", "x"}
    assert all(20 < r["sqnr_db"] < math.inf for r in rows)
    assert rows == sorted(rows, key=lambda r: r["sqnr_db"])


def test_sqnr_is_infinite_where_nothing_changed_and_refuses_bad_input() -> None:
    gm = calibrated()
    for q in qc.quantizers(gm).values():
        q.enabled = False  # quantizers off: every output equals the float model's
    assert all(r["sqnr_db"] == math.inf for r in qc.sqnr(gm, model(), BATCHES))
    with pytest.raises(qc.QCompileError, match="no batches"):
        qc.sqnr(gm, model(), [])
    piped = qc.qcompile(model(), {"quant": {"mode": "none"}, "pipeline": {"stages": 2}}, (X,))
    with pytest.raises(qc.QCompileError, match="unsplit"):
        qc.sqnr(piped, model(), BATCHES)


# -- refused files change nothing; uncalibrated graphs are not exported ------------------
def _exported(tmp_path: Path) -> tuple[Path, dict]:
    path = tmp_path / "a.encodings"
    qc.export_encodings(calibrated(), path)
    return path, json.loads(path.read_text())


def _state(gm: torch.fx.GraphModule) -> tuple[dict, dict]:
    flags = {n: (q.observe, q.enabled) for n, q in qc.quantizers(gm).items()}
    return {k: v.clone() for k, v in gm.state_dict().items()}, flags


def _assert_refused_unchanged(path: Path, data: dict, match: str) -> str:
    """Write ``data``, load it into a fresh graph: refused with ``match``, graph unchanged."""
    path.write_text(json.dumps(data))  # NaN/Infinity literals as Python's json writes them
    fresh = qc.qcompile(model(), "int8-static", (X,))
    before, flags = _state(fresh)
    with pytest.raises(qc.QCompileError, match=match) as excinfo:
        qc.load_encodings(fresh, path)
    after, flags_after = _state(fresh)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused file changed qparams"
    assert flags == flags_after
    assert str(path) in str(excinfo.value)
    return str(excinfo.value)


# "add" is the last quantizer applied: a load that is not atomic would already have
# changed every other one.
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), 0.0, -0.01,
                                   1e-50, 1e39])
def test_bad_scales_are_refused_and_nothing_is_loaded(tmp_path: Path, scale: float) -> None:
    path, data = _exported(tmp_path)
    data["activation_encodings"]["add"][0]["scale"] = scale
    msg = _assert_refused_unchanged(path, data, r"activation_encodings\['add'\]")
    assert "quantizer add_fake_quant" in msg and f"scale {scale!r}" in msg
    assert "finite number > 0" in msg


@pytest.mark.parametrize("scale", ["abc", "0.1", None, True, [0.1]])
def test_non_numeric_scales_are_refused(tmp_path: Path, scale: object) -> None:
    path, data = _exported(tmp_path)
    data["param_encodings"]["fc.weight"][2]["scale"] = scale
    msg = _assert_refused_unchanged(path, data, r"param_encodings\['fc\.weight'\]")
    assert f"entry [2] scale {scale!r} is not a number" in msg
    assert "quantizer fc.weight_fake_quant" in msg


@pytest.mark.parametrize(("key", "zero_point", "problem"), [
    ("add", 128, r"outside the quantizer's range \[0, 127\]"),
    ("add", -1, r"outside the quantizer's range \[0, 127\]"),
    ("fc.weight", 200, r"outside the quantizer's range \[-128, 127\]"),
    ("add", 1.5, "is not an integer"),
    ("add", "3", "is not an integer"),
])
def test_bad_zero_points_are_refused(tmp_path: Path, key: str, zero_point: object,
                                     problem: str) -> None:
    path, data = _exported(tmp_path)
    section = "param_encodings" if key.endswith("weight") else "activation_encodings"
    data[section][key][-1]["zero_point"] = zero_point
    msg = _assert_refused_unchanged(path, data, problem)
    assert f"{section}[{key!r}]" in msg and f"zero_point {zero_point!r}" in msg


def test_malformed_entries_are_refused(tmp_path: Path) -> None:
    path, data = _exported(tmp_path)
    del data["activation_encodings"]["add"][0]["scale"]
    _assert_refused_unchanged(path, data, r"entry \[0\] has no 'scale'")
    _, data = _exported(tmp_path)
    data["activation_encodings"]["add"] = {"scale": 0.1}
    _assert_refused_unchanged(path, data, "expected a list of encoding objects")
    _assert_refused_unchanged(path, [1, 2], "expected a JSON object")  # type: ignore[arg-type]


def test_integral_float_zero_point_is_accepted(tmp_path: Path) -> None:
    path, data = _exported(tmp_path)
    z = data["activation_encodings"]["add"][0]["zero_point"]
    data["activation_encodings"]["add"][0]["zero_point"] = float(z)
    path.write_text(json.dumps(data))
    gm = qc.load_encodings(qc.qcompile(model(), "int8-static", (X,)), path)
    assert int(qc.quantizers(gm)["add_fake_quant"].zero_point) == z


def test_aimet_fields_alone_load(tmp_path: Path) -> None:
    """A file with AIMET's fields only (``offset``, no ``zero_point`` nor qcompile's own)
    loads: the zero point is ``-offset``."""
    path, data = _exported(tmp_path)
    aimet = {"bitwidth", "dtype", "is_symmetric", "scale", "offset", "min", "max", "dynamic"}
    for section in ("param_encodings", "activation_encodings"):
        for entries in data[section].values():
            for e in entries:
                for k in set(e) - aimet:
                    del e[k]
    path.write_text(json.dumps(data))
    gm = qc.load_encodings(qc.qcompile(model(), "int8-static", (X,)), path)
    for name, fq in qc.quantizers(calibrated()).items():
        assert torch.equal(qc.quantizers(gm)[name].scale, fq.scale)
        assert torch.equal(qc.quantizers(gm)[name].zero_point, fq.zero_point)


def test_uncalibrated_static_graph_is_not_exported(tmp_path: Path) -> None:
    gm = qc.qcompile(model(), "int8-static", (X,))
    path = tmp_path / "u.encodings"
    with pytest.raises(qc.QCompileError, match="no ranges yet") as excinfo:
        qc.export_encodings(gm, path)
    assert excinfo.value.fix == "run qc.calibrate(gm, batches) first"
    assert list(tmp_path.iterdir()) == []  # no file, no temporary left behind
    path.write_text("old")  # an existing file is left as it was
    with pytest.raises(qc.QCompileError):
        qc.export_encodings(gm, path)
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]


def test_untrained_qat_graph_is_not_exported(tmp_path: Path) -> None:
    gm = qc.qcompile(model(), "int8-qat", (X,))
    with pytest.raises(qc.QCompileError, match="no ranges yet") as excinfo:
        qc.export_encodings(gm, tmp_path / "q.encodings")
    assert "train it" in excinfo.value.fix
    gm.train()
    gm(X)  # one training step's forward: its observations wait for the optimizer step
    with pytest.raises(qc.QCompileError, match="no ranges yet") as excinfo:
        qc.export_encodings(gm, tmp_path / "q.encodings")
    assert "qc.freeze(gm)" in excinfo.value.fix
    qc.freeze(gm)  # applies them: the observers have ranges
    qc.export_encodings(gm, tmp_path / "q.encodings")
    assert (tmp_path / "q.encodings").is_file()


def test_export_replaces_the_file_atomically(tmp_path: Path) -> None:
    path = tmp_path / "a.encodings"
    path.write_text("old")
    qc.export_encodings(calibrated(), path)
    assert json.loads(path.read_text())["version"] == "1.0.0"
    assert list(tmp_path.iterdir()) == [path]  # the temporary file was renamed over it
    with pytest.raises(qc.QCompileError, match="does not exist"):
        qc.export_encodings(calibrated(), tmp_path / "missing" / "a.encodings")
