"""Exports from a tensor-parallel run: ``qc.export_gguf`` and ``qc.save_pretrained`` of a
graph ``qc.distributed.wrap`` sharded across two gloo ranks (tp 2, a 2-layer Llama with
GQA: every Linear and the embedding sharded), and across four (dp 2 x tp 2: FSDP2 shards
every block's weights over dp as well). Every rank calls the export, each sharded weight
is gathered in turn, rank 0 writes; the file (GGUF, ``gguf-q4_0-qat``) and the checkpoint
(``8da4w-qat``) are byte-identical to one process's export of the same graph, freshly
compiled and after one training step on the ranks. A graph whose pipeline stages were
trained on different ranks (pp 2; pp 2 x tp 2, pp 2 x dp 2 on four) exports what one
process writes for the trained stages. Calls the ranks do not make
together are one ``QCompileError`` on every rank, before any gather (the messages say which
meeting refused it; a rank left in a gather would fail the launch's deadline).

The cases run in ``_tp_export_worker.py``: one supervised launch runs every case the
selected tests name (about 15 s); each test asserts on the JSON the ranks wrote. With
``QCOMPILE_SWEEP=1``, as ``.ci/run`` runs it after the default suite (the exporters' own
tests and the ranks' training are in the default suite).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from dist_cases import uses, wanted_cases

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("compressed_tensors")

pytestmark = [pytest.mark.dist, pytest.mark.skipif(
    os.environ.get("QCOMPILE_SWEEP") != "1",
    reason="a 2-rank launch of exports: .ci/run runs it (QCOMPILE_SWEEP=1)")]

WORKER = Path(__file__).with_name("_tp_export_worker.py")
ORDER = ["gguf", "hf", "gguf_fsdp2", "hf_fsdp2", "gguf_once", "gguf_moe", "hf_moe",
         "gguf_moe_within", "hf_moe_within", "mistakes",
         "gguf_pp", "hf_pp", "adapters_pp", "local_pp", "mistakes_pp"]
# 4 ranks: dp 2 x tp 2, and two pipeline stages each across 2 ranks
ORDER4 = ["gguf", "hf", "gguf_moe_within", "hf_moe_within", "gguf_pp_tp", "hf_pp_tp_moe", "hf_pp_dp",
          "adapters_pp_tp"]
LAUNCH_DEADLINE = 120.0  # seconds for every case of the launch (about 15 s normally)
# every linear layer's weight and the embedding are sharded (norms stay whole)
SHARDED = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")} | {"model.embed_tokens.weight",
                                                          "lm_head.weight"}


@pytest.fixture(scope="module")
def dist_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             dist_launcher: Any) -> Any:
    return dist_launcher(WORKER, wanted_cases(request, ORDER), tmp_path_factory.mktemp("tpx"),
                         LAUNCH_DEADLINE)


@pytest.fixture(scope="module")
def dist_run4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              dist_launcher: Any) -> Any:
    return dist_launcher(WORKER, wanted_cases(request, ORDER4), tmp_path_factory.mktemp("tpx4"),
                         LAUNCH_DEADLINE, world=4)


@pytest.mark.parametrize("case, files", [("gguf", [""]),
                                         ("hf", ["config.json", "model.safetensors"])])
def test_rank0_writes_what_one_process_writes(dist_run: Any, case: str,
                                              files: list[str]) -> None:
    """Both ranks call the export on the sharded graph and return the path; rank 0's
    file(s) equal, byte for byte, those one process writes for the same graph never
    sharded (and for the model compiled without a tensor_parallel section); after one SGD
    step on the ranks, those one process writes for the gathered trained state."""
    ranks = dist_run.case(case)
    for got in ranks:
        assert set(got["sharded"]) == SHARDED, got["sharded"]
        assert got["mesh_dims"] == ["tp"], got["mesh_dims"]
    _rank0_wrote_one_process_files(ranks, case, files)


@pytest.mark.parametrize("case, files", [("gguf", [""]),
                                         ("hf", ["config.json", "model.safetensors"])])
def test_dp_x_tp_rank0_writes_what_one_process_writes(dist_run4: Any, case: str,
                                                      files: list[str]) -> None:
    """dp 2 x tp 2: every weight is a DTensor over the 2-D mesh (the norms over dp), each
    gathered from all four ranks as the export reaches it; rank 0's file(s) equal one
    process's, fresh (the one-process reference is compiled with the same spec: its blocks
    child graphs, never sharded) and after one SGD step."""
    ranks = dist_run4.case(case)
    norms = {f"model.layers.{i}.{n}.weight" for i in range(2)
             for n in ("input_layernorm", "post_attention_layernorm")} | {"model.norm.weight"}
    for got in ranks:
        assert set(got["sharded"]) == SHARDED | norms, got["sharded"]
        assert got["mesh_dims"] == ["dp", "tp"], got["mesh_dims"]
    _rank0_wrote_one_process_files(ranks, case, files)


@pytest.mark.parametrize("case, files", [("gguf_fsdp2", [""]),
                                         ("hf_fsdp2", ["config.json", "model.safetensors"]),
                                         ("gguf_once", [""])])
def test_fsdp2_rank0_writes_what_one_process_writes(dist_run: Any, case: str,
                                                    files: list[str]) -> None:
    """FSDP2 alone (dp 2; ``qc.distributed.wrap``, or ``compile_once`` loading the shards):
    every weight is a DTensor over dp, gathered as the export reaches it; rank 0 writes one
    process's file(s)."""
    ranks = dist_run.case(case)
    norms = {f"model.layers.{i}.{n}.weight" for i in range(2)
             for n in ("input_layernorm", "post_attention_layernorm")} | {"model.norm.weight"}
    for got in ranks:
        assert set(got["sharded"]) == SHARDED | norms, got["sharded"]
        assert got["mesh_dims"] == [], got["mesh_dims"]  # fully_shard's own 1-D mesh
    _rank0_wrote_one_process_files(ranks, case, files)


@pytest.mark.parametrize("case, files", [
    ("gguf_moe", [""]), ("hf_moe", ["config.json", "model.safetensors"]),
    ("gguf_moe_within", [""]), ("hf_moe_within", ["config.json", "model.safetensors"])])
def test_moe_rank0_writes_what_one_process_writes(dist_run: Any, case: str,
                                                  files: list[str]) -> None:
    """A Mixtral at tp 2, its experts sharded by expert (two of four per rank), or within
    each expert (three experts: each rank holds every expert's half of the gate and up rows
    and of down's input features): each [experts, ...] weight is gathered whole as the
    export reaches it; rank 0 writes one process's file(s) (GGUF's per-layer expert
    tensors, transformers' per-expert layers)."""
    ranks = dist_run.case(case)
    for got in ranks:
        experts = {f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                   for p in ("gate_up_proj", "down_proj")}
        assert experts <= set(got["sharded"]), got["sharded"]
    _rank0_wrote_one_process_files(ranks, case, files)


@pytest.mark.parametrize("case, files", [
    ("gguf_moe_within", [""]), ("hf_moe_within", ["config.json", "model.safetensors"])])
def test_dp_x_tp_experts_within_rank0_writes_what_one_process_writes(
        dist_run4: Any, case: str, files: list[str]) -> None:
    """dp 2 x tp 2, a Mixtral's three experts sliced within each expert over tp and
    FSDP2-sharded over dp: rank 0 writes one process's file(s), fresh and trained."""
    ranks = dist_run4.case(case)
    for got in ranks:
        assert got["mesh_dims"] == ["dp", "tp"], got["mesh_dims"]
    _rank0_wrote_one_process_files(ranks, case, files)


def _rank0_wrote_one_process_files(ranks: list[dict[str, Any]], case: str,
                                   files: list[str]) -> None:
    r0 = ranks[0]
    for got in ranks:
        for when in ("fresh", "trained"):
            assert got[when]["returned"], (case, when, got[when])
    for when in ("fresh", "trained"):
        got = r0[when]
        assert got["files"] == files, got
        assert got["bytes"] > 0, got
        assert got["identical"], f"{case} {when}: {got['differ']} differ from one process's"
        assert got["leftovers"] == [], got
    assert r0["fresh"]["plain_identical"], r0["fresh"]
    assert r0["trained"]["differs_from_fresh"], "the training step changed nothing"


@uses("mistakes")
@pytest.mark.parametrize("what, parts", [
    ("only_rank0", ["different qcompile calls", "rank 0: 'export_gguf'",
                    "rank 1: 'save_pretrained'"]),
    ("path_differs", ["export_gguf: the ranks disagree on path", "path0.gguf", "path1.gguf"]),
    ("config_differs", ["export_gguf: the ranks disagree on config.rms_norm_eps"]),
])
def test_a_call_the_ranks_do_not_make_alike_is_one_error_on_both(dist_run: Any, what: str,
                                                                 parts: list[str]) -> None:
    """Rank 0 exports while rank 1 saves a checkpoint; another path, another config on
    rank 1: the same QCompileError on both ranks, at once, before any gather."""
    results = tuple(r[what] for r in dist_run.case("mistakes"))
    for rank, got in enumerate(results):
        assert got["raised"] == "QCompileError", (rank, got)
        for part in parts:
            assert part in got["message"], (rank, part, got["message"])
        assert got["group_works"], (rank, got)
    assert results[0]["message"] == results[1]["message"]


@uses("mistakes")
def test_a_path_rank0_refuses_stops_every_rank(dist_run: Any) -> None:
    """The output path exists: rank 0 (the writer) raises its own refusal, rank 1 one
    naming it, both before any gather; the file is untouched."""
    r0, r1 = (r["exists"] for r in dist_run.case("mistakes"))
    assert r0["raised"] == "QCompileError" and "exists.gguf' exists" in r0["message"], r0
    assert "remove it first" in r0["fix"], r0
    assert r1["raised"] == "QCompileError", r1
    assert "another rank refused the call" in r1["message"], r1
    assert "rank 0: " in r1["message"] and "rank 1" not in r1["message"], r1
    assert "own error" in r1["fix"], r1
    for got in (r0, r1):
        assert got["group_works"] and got["kept"], got


@uses("mistakes")
def test_a_nan_in_one_ranks_shard_stops_every_rank(dist_run: Any) -> None:
    """save_pretrained with a NaN in rank 1's shard of a weight: rank 1 names the tensor,
    rank 0 stops with it, before any gather."""
    r0, r1 = (r["nan_on_rank1"] for r in dist_run.case("mistakes"))
    assert r1["raised"] == "QCompileError" and "model.layers.0.mlp.up_proj.weight" in (
        r1["message"]) and "NaN" in r1["message"], r1
    assert r0["raised"] == "QCompileError" and "another rank refused" in r0["message"], r0
    assert "rank 1: " in r0["message"] and "rank 0" not in r0["message"], r0
    for got in (r0, r1):
        assert got["group_works"], got


@uses("mistakes")
def test_an_export_rank1_never_makes_is_named_and_the_ranks_meet_again(dist_run: Any) -> None:
    """Rank 0 exports alone, rank 1 makes no qcompile call: rank 0 gives up after
    QCOMPILE_AGREE_TIMEOUT (2 s here) naming rank 1; rank 1's next call skips the meeting
    it missed (with a warning), both ranks then get the same refusal of that call, and an
    export both make writes the file. No refused call wrote anything."""
    results = dist_run.case("mistakes")
    r0, r1 = (r["absent"] for r in results)
    assert r0["raised"] == "QCompileError", r0
    assert "rank 1 did not reach export_gguf within 2 s (rank 0 did)" in r0["message"], r0
    assert "QCOMPILE_AGREE_TIMEOUT" in r0["fix"], r0
    assert r1["raised"] is None, (r0, r1)
    a0, a1 = (r["after_absent"] for r in results)
    assert a0["raised"] == a1["raised"] == "QCompileError", (a0, a1)
    assert a0["message"] == a1["message"] and "q4_0" in a0["message"], (a0, a1)
    assert a0["warnings"] == [], a0
    assert len(a1["warnings"]) == 1 and "called export_gguf without this rank" in (
        a1["warnings"][0]), a1
    for rank, r in enumerate(results):
        assert r["good"]["raised"] is None and r["good"]["written"], (rank, r["good"])
        assert r["unwritten"] == [], (rank, r["unwritten"])


@pytest.mark.parametrize("case, files, world", [
    ("gguf_pp", [""], 2), ("hf_pp", ["config.json", "model.safetensors"], 2),
    ("gguf_pp_tp", [""], 4), ("hf_pp_tp_moe", ["config.json", "model.safetensors"], 4),
    ("hf_pp_dp", ["config.json", "model.safetensors"], 4)])
def test_pipeline_stages_export_what_one_process_writes(request: pytest.FixtureRequest,
                                                        case: str, files: list[str],
                                                        world: int) -> None:
    """Two pipeline stages, each trained on its own rank(s) for two GPipe steps (pp 2; pp 2
    x tp 2, the Mixtral's experts by expert; pp 2 x dp 2 with FSDP2): every rank calls the
    export on the graph ``qc.qcompile`` returned, where each rank trained only its own
    stage; rank 0's file(s) equal, byte for byte, those one process writes for the trained
    stages' state gathered by torch (``full_tensor``) and loaded into an unsplit compile.
    Every rank's own stage is left as it was."""
    run = request.getfixturevalue("dist_run" if world == 2 else "dist_run4")
    ranks = run.case(case)
    for got in ranks:
        assert got["returned"] and got["own_stage_kept"], got
        # what reads one whole model on a rank is refused where each stage is sharded
        # (qc.convert may refuse the preset's grid first)
        for what, error in got["refused"].items():
            assert error["raised"] == "QCompileError", (what, error)
            assert what == "convert" or "sharded" in error["message"], (what, error)
    r0 = ranks[0]
    assert r0["missing"] == [], r0["missing"]
    assert r0["stages_trained"] > 0, r0  # both stages' weights moved in training
    assert r0["files"] == files and r0["bytes"] > 0, r0
    assert r0["identical"], f"{case}: {r0['differ']} differ from one process's"
    assert r0["leftovers"] == [], r0


@pytest.mark.parametrize("case, world", [("adapters_pp", 2), ("adapters_pp_tp", 4)])
def test_pipeline_stages_save_every_stages_trained_adapters(request: pytest.FixtureRequest,
                                                            case: str, world: int) -> None:
    """``qlora-nf4`` trained in two pipeline stages (pp 2; pp 2 x tp 2, the adapters
    sharded as their bases): every rank calls ``qc.save_adapters`` on the graph
    ``qc.qcompile`` returned; rank 0's file holds every adapter of both stages as the
    ranks that trained it hold it (not rank 0's untrained copies of the other stage)."""
    ranks = request.getfixturevalue("dist_run" if world == 2 else "dist_run4").case(case)
    assert all(got["returned"] for got in ranks), ranks
    r0 = ranks[0]
    assert r0["saved"] == r0["trained"] and r0["trained"], (r0["saved"], r0["trained"])
    assert r0["equal"] == r0["trained"], sorted(set(r0["trained"]) - set(r0["equal"]))
    assert r0["moved"] == len([k for k in r0["trained"] if ".lora_B." in k]), r0["moved"]


@uses("local_pp")
def test_pipeline_stages_convert_and_export_onnx_and_encodings_whole(dist_run: Any) -> None:
    """``int8-qat`` trained in two pipeline stages (pp 2): every rank calls ``qc.convert``
    (each gets the whole converted model, equal to one process's conversion of the
    stages' gathered state), ``qc.export_encodings`` and ``qc.export_onnx`` (rank 0 writes
    what one process writes: the same encodings, an ONNX model computing the same
    logits)."""
    ranks = dist_run.case("local_pp")
    for rank, got in enumerate(ranks):
        assert got["convert_equal"], (rank, got["convert_gap"])
    assert ranks[0]["encodings_equal"], ranks[0]
    assert ranks[0]["onnx_gap"] <= 1e-5, ranks[0]


@uses("mistakes_pp")
def test_pipeline_exports_the_ranks_do_not_make_alike_are_one_error(dist_run: Any) -> None:
    """Exports of a pipeline-placed graph with another path on rank 1, or to a path that
    exists on rank 0 (the writer): a QCompileError on both ranks before any stage's state
    moves; nothing written, the file kept, the group still works."""
    results = dist_run.case("mistakes_pp")
    for rank, r in enumerate(results):
        got = r["path_differs"]
        assert got["raised"] == "QCompileError", (rank, got)
        assert "the ranks disagree on path" in got["message"], (rank, got)
        assert got["group_works"] and r["exists"]["group_works"], (rank, r)
        assert r["exists"]["raised"] == "QCompileError" and r["exists"]["kept"], (rank, r)
        assert r["unwritten"] == [], (rank, r["unwritten"])
    assert "pp_exists.gguf' exists" in results[0]["exists"]["message"], results[0]
    assert "another rank refused the call" in results[1]["exists"]["message"], results[1]
