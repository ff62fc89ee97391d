"""qcompile-bench adapters --quick: a smoke run of every variant (tiny model, one step, in
this process); the numbers are checked for sanity, never timed."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")


@pytest.mark.e2e
def test_quick_adapters_suite() -> None:
    from qcompile.tools.bench.suites import SUITES
    from qcompile.tools.bench.suites.adapters import VARIANTS, adapters_text, bench_adapters

    assert SUITES["adapters"].run is bench_adapters and SUITES["adapters"].threads == 2
    result = bench_adapters(quick=True)
    rows = result["variants"]
    assert set(rows) == set(VARIANTS)
    for variant, row in rows.items():
        if "skipped" in row:  # bitsandbytes only, and only where it does not run
            assert variant == "bnb_nf4", row
            continue
        assert row["step_s"] > 0 and row["step_vs_peft"] > 0, variant
        assert len(row["losses"]) == 1 and 0 < row["loss_after"] < 10, variant
        assert row["trainable"] == rows["peft"]["trainable"], variant  # the same adapters
        assert row["saved_mb"] > 0 and row["base_mb"] > 0, variant
    assert rows["peft"]["base_vs_fp32"] == 1.0 and rows["qat_int4_g32"]["base_vs_fp32"] == 1.0
    assert rows["int8"]["base_vs_fp32"] < 0.30
    for fmt in ("int4_g32", "nf4", "nvfp4", "mxfp4"):
        assert rows[fmt]["base_vs_fp32"] < 0.20, fmt
        assert rows[fmt]["frozen_layers"] == 12, fmt  # 2 blocks x q, k, v, o, up, down
    # lora_B starts at zero: before training each variant computes its base model, and a
    # frozen base computes what its QAT base computes
    assert rows["int4_g32"]["losses"][0] == pytest.approx(rows["qat_int4_g32"]["losses"][0],
                                                          rel=1e-5)
    assert rows["int8"]["losses"][0] == pytest.approx(rows["peft"]["losses"][0], rel=1e-2)
    text = adapters_text(result)
    assert all(v in text for v in VARIANTS) and "vs peft" in text
