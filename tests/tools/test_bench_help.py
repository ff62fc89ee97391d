"""``qcompile-bench --help`` describes every suite in one line, and a run on a machine
busier than its cores says so on stderr when the suite starts and when it ends (the load
reading is faked here; no suite is timed)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from qcompile.tools.bench import SUITES, SUMMARIES, Suite, main


def test_help_describes_every_suite_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert set(SUMMARIES) == set(SUITES)
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("usage: qcompile-bench") and len(lines[0]) <= 100
    for name in SUITES:
        mine = [line for line in lines if line.split()[:1] == [name]]
        assert len(mine) == 1, (name, mine)
        assert mine[0].endswith(SUMMARIES[name]) and len(mine[0]) <= 100, mine[0]
        assert len(SUMMARIES[name].split()) >= 5, name  # a description, not a label


def readings(monkeypatch: pytest.MonkeyPatch, loads: list[float], cores: int) -> list[float]:
    """Fake the 1-minute load average (one reading per call, in order) and the core count;
    returns what is left unread."""
    left = list(loads)
    monkeypatch.setattr(os, "getloadavg", lambda: (left.pop(0), 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    return left


@pytest.fixture
def tiny_suite(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setitem(SUITES, "tiny", Suite(lambda quick: {"tiny": {"seconds": 0.5}}))
    yield "tiny"


def test_a_busy_machine_is_noted_at_start_and_end(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tiny_suite: str) -> None:
    left = readings(monkeypatch, [9.0, 4.5], cores=4)
    assert main([tiny_suite, "--json"]) == 0
    assert not left, "read once at the start, once at the end"
    out, err = capsys.readouterr()
    assert json.loads(out) == {"tiny": {"seconds": 0.5}}  # the results stay clean JSON
    notes = err.strip().splitlines()
    assert len(notes) == 2, err
    assert "busy at the start" in notes[0] and "9.00 on 4 cores" in notes[0]
    assert "busy at the end" in notes[1] and "4.50 on 4 cores" in notes[1]
    assert all("noisy" in n and "tiny" in n for n in notes)


@pytest.mark.parametrize(("loads", "noted"), [([1.0, 4.0], []), ([0.5, 6.0], ["end"]),
                                              ([8.0, 2.0], ["start"])])
def test_only_a_load_above_the_core_count_is_noted(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_suite: str,
        loads: list[float], noted: list[str]) -> None:
    readings(monkeypatch, loads, cores=4)
    assert main([tiny_suite]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "tiny: seconds 0.5"
    assert [line.split(" at the ")[1].split()[0] for line in err.strip().splitlines()] == noted


def test_no_load_average_no_note(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str], tiny_suite: str) -> None:
    def unavailable() -> tuple[float, float, float]:
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert main([tiny_suite]) == 0
    assert capsys.readouterr().err == ""
