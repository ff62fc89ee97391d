"""What ``qcompile-inspect`` writes (``--graph dot|svg|html``, ``search --plot``) gets the mode
the umask gives a new file (matplotlib and a temporary file alone gave 0600), and a write
that fails or is interrupted half-way leaves the previous picture and no temporary."""

from __future__ import annotations

import errno
import stat
import textwrap
from pathlib import Path

import pytest

from qcompile.mixed_precision import ParetoPoint, SearchDetails, SearchGroup
from qcompile.tools.inspect_cli import main

MODEL = textwrap.dedent("""\
    import torch
    from torch import nn

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
""")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("writes") / "writes_model.py"
    path.write_text(MODEL, encoding="utf-8")
    return path


def show(model_file: Path, out: Path, kind: str) -> int:
    return main(["show", "int8-qat", "--model", f"{model_file}:net", "--input-shape", "2x8",
                 "--graph", kind, "--layout", "python", "--out", str(out)])


def details_file(folder: Path) -> Path:
    groups = [SearchGroup(name="0", layers=["0"], parameters=64, scores=[0.1, 0.001],
                          sqnr_db=[20.0, 45.0])]
    pareto = [ParetoPoint(avg_weight_bits=b, weight_bytes=n, predicted_error=e,
                          chosen={"0": c}) for b, n, e, c in ((4.0, 32, 0.1, 0),
                                                             (8.0, 64, 0.001, 1))]
    details = SearchDetails(
        metric="sqnr", granularity="layer", budget={"avg_weight_bits": 8.0},
        candidates=["int4/per_group32", "int8/per_channel"], bits=[4.0, 8.0], groups=groups,
        chosen={"0": 1}, predicted_error=0.001, avg_weight_bits=8.0, weight_bytes=64,
        pareto=pareto, seconds={"scoring": 0.1, "solving": 0.01}, batches=1, ranks=1)
    path = folder / "details.json"
    path.write_text(details.model_dump_json(), encoding="utf-8")
    return path


def test_pictures_get_the_umask_mode(tmp_path: Path, model_file: Path, umask: int,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    for kind in ("dot", "svg", "html"):
        assert show(model_file, tmp_path / f"g.{kind}", kind) == 0, capsys.readouterr().err
    want = {0o022: 0o644, 0o077: 0o600}[umask]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {
        "g.dot": want, "g.svg": want, "g.html": want}


def test_an_interrupted_picture_leaves_the_previous_one(
        tmp_path: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.svg"
    assert show(model_file, out, "svg") == 0
    before = out.read_bytes()
    real = Path.write_text

    def disk_full(self: Path, data: str, *args, **kwargs) -> int:
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    capsys.readouterr()
    assert show(model_file, out, "svg") == 1
    assert "No space left" in capsys.readouterr().err
    monkeypatch.setattr(Path, "write_text", lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        show(model_file, out, "svg")
    monkeypatch.undo()
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["g.svg"]


def test_the_pareto_plot_gets_the_mode_and_an_interrupted_one_leaves_the_old(
        tmp_path: Path, umask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    report = details_file(tmp_path)
    plot = tmp_path / "p.png"
    assert main(["search", str(report), "--plot", str(plot)]) == 0
    assert stat.S_IMODE(plot.stat().st_mode) == {0o022: 0o644, 0o077: 0o600}[umask]
    before = plot.read_bytes()
    real = Figure.savefig

    def interrupted(self: Figure, fname: object, **kwargs: object) -> None:
        real(self, fname, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["search", str(report), "--plot", str(plot)])
    monkeypatch.undo()
    assert plot.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["details.json", "p.png"]
