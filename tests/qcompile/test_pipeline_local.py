"""A pipeline-placed graph run in one process: ``pipeline.microbatches`` is the schedules'
setting, and the report says that one process runs each stage on the whole batch."""

from __future__ import annotations

import torch
from pipeline_models import ResidualMLP, qat

import qcompile as qc


def notes(gm) -> list[str]:
    return [n for p in qc.report(gm).passes for n in p.notes]


def test_microbatches_in_one_process_are_noted_not_silently_ignored():
    torch.manual_seed(0)
    model = ResidualMLP(d=8, depth=3)
    x = torch.randn(8, 8)
    gm = qc.qcompile(model, qat(pipeline={"stages": 2, "microbatches": 4}),
                     example_inputs=(x,))
    noted = [n for n in notes(gm) if "pipeline.microbatches: 4" in n]
    assert len(noted) == 1
    assert "whole batch" in noted[0] and "tensor_split" in noted[0]
    assert "pipeline.microbatches: 4" in qc.report(gm).text()
    # the same numbers as the spec without micro-batches: one forward on the whole batch
    ref = qc.qcompile(model, qat(pipeline={"stages": 2}), example_inputs=(x,))
    assert torch.equal(gm(x), ref(x))
    assert not any("microbatches" in n for n in notes(ref))


def test_the_recipe_in_the_note_gives_the_whole_batch_result():
    # batch-independent model, frozen quantizers: chunks concatenated == whole batch
    torch.manual_seed(0)
    model = ResidualMLP(d=8, depth=3)
    x = torch.randn(8, 8)
    gm = qc.qcompile(model, qat(pipeline={"stages": 2, "microbatches": 4}),
                     example_inputs=(x,))
    gm(x)
    qc.freeze(gm)
    with torch.no_grad():
        whole = gm(x)
        chunks = torch.cat([gm(c) for c in torch.tensor_split(x, 4)])
    torch.testing.assert_close(chunks, whole, rtol=0, atol=1e-6)
