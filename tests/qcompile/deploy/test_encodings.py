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
    assert sorted(data["activation_encodings"]) == ["add", "conv.output", "fc.output"]
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


def test_encodings_of_another_graph_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.encodings"
    qc.export_encodings(calibrated(), path)
    other = qc.qcompile(nn.Sequential(nn.Linear(4, 4)), "int8-static", (torch.randn(2, 4),))
    with pytest.raises(qc.QCompileError, match="different graph"):
        qc.load_encodings(other, path)
    data = json.loads(path.read_text())
    data["param_encodings"]["conv.weight"] = data["param_encodings"]["conv.weight"][:2]
    path.write_text(json.dumps(data))
    with pytest.raises(qc.QCompileError, match=r"conv\.weight has 2 scale"):
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
    assert {r["node"] for r in rows} == {"relu", "add", "fc"}  # fc re-expressed as `linear`
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
