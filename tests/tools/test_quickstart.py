"""The quick-start example: QAT on real data stays within 2 accuracy points of fp32."""

from __future__ import annotations

import pytest

from qcompile.tools.quickstart import main, run


@pytest.mark.slow
def test_qat_matches_fp32_on_digits() -> None:
    lines: list[str] = []
    result = run(spec="int8-qat", epochs=6, finetune=2, seed=0,
                 echo=lambda *a: lines.append(" ".join(map(str, a))))
    assert result["fp32_accuracy"] > 0.9  # the task is learnt at all
    assert abs(result["qat_accuracy"] - result["fp32_accuracy"]) <= 0.02
    assert result["qat_losses"][-1] < 0.1
    text = "\n".join(lines)
    # 8 for the layers, 1 for the image the first conv reads (inputs: auto)
    assert "quantizers: 9" in text and "test accuracy" in text
    assert len(result["report"].quantizers) == 9


def test_demo_refuses_a_bad_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--spec", "no-such-preset", "--epochs", "1", "--finetune", "1"]) == 1
    err = capsys.readouterr().err
    assert "no-such-preset" in err and "int8-qat" in err
