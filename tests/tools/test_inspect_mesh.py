"""``qcompile-inspect show --world N``: the device mesh a spec lays out on N ranks, as text,
JSON and a picture (``<out stem>-mesh.svg``), and the errors of a world the spec does not fit.

The models live in a small file written per module (``mesh_models.py``): ``llama`` is a
two-block Llama from transformers (its tensor-parallel plan: q/k/v, gate/up and the LM head
colwise, o/down rowwise, the embedding by rows), ``mlp`` a stack of Linears with biases,
``broken`` a factory that raises (a world that does not fit is refused before the model is
built). Expected holdings are computed here from the model's own parameters with
``torch.chunk``, not from the code under test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch

from qcompile.tools.inspect_cli import main

pytest.importorskip("transformers")

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    def llama():
        import transformers

        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2)
        return transformers.LlamaForCausalLM(cfg).eval()


    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                             nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


    def broken():
        raise RuntimeError("factory exploded")
''')

SPECS = {
    # pp 2 x dp 2 x tp 2 on 8 ranks
    "tp_pp_fsdp.yaml": """\
        version: 1
        quant: {mode: qat}
        tensor_parallel: {size: 2}
        data_parallel: {kind: fsdp2}
        pipeline: {stages: 2}
        """,
    "tp.yaml": """\
        version: 1
        quant: {mode: qat}
        tensor_parallel: {size: 2}
        """,
    "pipe_ddp.yaml": """\
        version: 1
        quant: {mode: qat}
        data_parallel: {kind: ddp}
        pipeline: {stages: 2}
        """,
    "pipe.yaml": """\
        version: 1
        quant: {mode: qat}
        pipeline: {stages: 2}
        """,
}
LLAMA = ["--input-shape", "1x8", "--dtype", "int64"]
MLP = ["--input-shape", "2x16"]
COLWISE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"}  # output rows
ROWWISE = {"o_proj", "down_proj"}  # input columns
BY_ROWS = {"embed_tokens"}  # an embedding by vocabulary rows
SVG = "{http://www.w3.org/2000/svg}"


def invoke(*argv: str) -> tuple[int, str, str]:
    """``main(argv)`` in-process -> (exit code, stdout, stderr); for module fixtures too,
    which cannot take pytest's capsys."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("mesh")
    (d / "mesh_models.py").write_text(MODELS, encoding="utf-8")
    for name, text in SPECS.items():
        (d / name).write_text(textwrap.dedent(text), encoding="utf-8")
    return d


def ref(work: Path, factory: str) -> str:
    return f"{work / 'mesh_models.py'}:{factory}"


@pytest.fixture(scope="module")
def llama_params(work: Path) -> dict[str, tuple[int, ...]]:
    """The Llama's parameter shapes, from the model itself."""
    spec = importlib.util.spec_from_file_location("mesh_models_here", work / "mesh_models.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return {n: tuple(p.shape) for n, p in module.llama().named_parameters()}


@pytest.fixture(scope="module")
def eight(work: Path) -> dict[str, Any]:
    """``show`` of the pp 2 x dp 2 x tp 2 spec on 8 ranks, JSON with ``--graph svg``: one
    compile for the JSON and picture tests."""
    out = work / "eight.svg"
    rc, stdout, err = invoke("show", str(work / "tp_pp_fsdp.yaml"), "--model",
                             ref(work, "llama"), *LLAMA, "--world", "8", "--format", "json",
                             "--graph", "svg", "--layout", "python", "--out", str(out))
    assert rc == 0, err
    return json.loads(stdout)


def held(shapes: dict[str, tuple[int, ...]], tp: int, t: int, dp: int = 1, d: int = 0
         ) -> int:
    """Elements rank (tp index ``t``, dp index ``d``) keeps of ``shapes``: the Llama plan's
    tp split, then FSDP2's dim-0 chunk over ``dp`` (both as ``torch.chunk`` cuts)."""
    total = 0
    for name, shape in shapes.items():
        x = torch.empty(shape, device="meta")
        layer = name.rsplit(".", 2)[-2]
        if layer in COLWISE or layer in BY_ROWS:
            x = x.chunk(tp, 0)[t]
        elif layer in ROWWISE:
            x = x.chunk(tp, 1)[t]
        if dp > 1:
            pieces = x.chunk(dp, 0)
            x = pieces[d] if d < len(pieces) else x[:0]
        total += x.numel()
    return total


def math_prod(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def stage_of(name: str) -> int:
    """The two-block Llama's pipeline cut: the embedding and block 0, then the rest."""
    return 0 if name.startswith(("model.embed_tokens.", "model.layers.0.")) else 1


# -- JSON -----------------------------------------------------------------------------------
def test_coordinates_follow_the_torch_mesh_layout(eight: dict[str, Any]) -> None:
    """dims pp, dp, tp in that order, tp innermost: rank = (pp * dp + d) * tp + t; each
    rank's stage is its pp index."""
    mesh = eight["mesh"]
    assert mesh["dims"] == {"pp": 2, "dp": 2, "tp": 2} and list(mesh["dims"]) == [
        "pp", "dp", "tp"]
    assert mesh["world"] == 8 and mesh["data_parallel"] == "fsdp2"
    assert [r["rank"] for r in mesh["ranks"]] == list(range(8))
    seen = set()
    for r in mesh["ranks"]:
        c = r["coords"]
        assert set(c) == {"pp", "dp", "tp"}
        assert r["rank"] == (c["pp"] * 2 + c["dp"]) * 2 + c["tp"], r
        assert r["stage"] == c["pp"] and r["stages"] == [c["pp"]]
        assert r["holds"]["tp_shard"] == c["tp"] and r["holds"]["fsdp2_chunk"] == c["dp"]
        seen.add((c["pp"], c["dp"], c["tp"]))
    assert len(seen) == 8


def test_fsdp2_ranks_hold_their_chunk_of_their_tp_shard(
        eight: dict[str, Any], llama_params: dict[str, tuple[int, ...]]) -> None:
    """Each rank: its stage's parameters, its tp shard of the planned layers, then 1/dp of
    the rows (ceil, per torch.chunk); the stage records agree with the assumed cut."""
    mesh, summary = eight["mesh"], eight["summary"]
    per_stage = [{n: s for n, s in llama_params.items() if stage_of(n) == k} for k in (0, 1)]
    assert [st["parameters"] for st in summary["stages"]] == [
        sum(math_prod(s) for s in shapes.values()) for shapes in per_stage]
    total = sum(math_prod(s) for s in llama_params.values())
    assert mesh["parameters"] == total
    for r in mesh["ranks"]:
        c = r["coords"]
        want = held(per_stage[c["pp"]], 2, c["tp"], 2, c["dp"])
        assert r["holds"]["parameters"] == want, r
        assert r["holds"]["parameter_bytes"] == 4 * want  # fp32 weights
        assert r["holds"]["share"] == pytest.approx(want / total, abs=1e-6)
    # the 2 x 2 ranks of a stage hold it once, but for the tp-replicated norms (twice)
    norms = [n for n in llama_params if "norm" in n]
    for k in (0, 1):
        stage_ranks = [r for r in mesh["ranks"] if r["coords"]["pp"] == k]
        replicated = sum(math_prod(llama_params[n]) for n in norms if stage_of(n) == k)
        assert sum(r["holds"]["parameters"] for r in stage_ranks) == (
            summary["stages"][k]["parameters"] + replicated)


def test_tp_shards_of_one_replica_add_up_to_the_model(
        work: Path, llama_params: dict[str, tuple[int, ...]]) -> None:
    """No fsdp, no pipeline: the tp ranks' shards together are the model, with the
    replicated norms once per rank; each rank's ranges are its torch.chunk of each dim."""
    rc, out, err = invoke("show", str(work / "tp.yaml"), "--model", ref(work, "llama"),
                          *LLAMA, "--world", "2", "--format", "json")
    assert rc == 0, err
    mesh = json.loads(out)["mesh"]
    assert mesh["dims"] == {"tp": 2} and mesh["data_parallel"] == "none"
    total = sum(math_prod(s) for s in llama_params.values())
    norms = sum(math_prod(s) for n, s in llama_params.items() if "norm" in n)
    counts = [r["holds"]["parameters"] for r in mesh["ranks"]]
    assert counts == [held(llama_params, 2, 0), held(llama_params, 2, 1)]
    assert sum(counts) == total + norms  # each norm whole on both ranks
    for r in mesh["ranks"]:
        assert r["stage"] is None and r["stages"] == [] and r["holds"]["fsdp2_chunk"] is None
        t = r["coords"]["tp"]
        ranges = {(e["what"], e["of"]): (e["start"], e["stop"], e["layers"])
                  for e in r["holds"]["tp_ranges"]}
        # q_proj 64 rows (and the 64-row lm_head), k/v 32, gate/up 128
        assert ranges[("colwise rows", 64)] == (32 * t, 32 * t + 32, 3)
        assert ranges[("colwise rows", 32)] == (16 * t, 16 * t + 16, 4)
        assert ranges[("colwise rows", 128)] == (64 * t, 64 * t + 64, 4)
        assert ranges[("rowwise input columns", 64)] == (32 * t, 32 * t + 32, 2)
        assert ranges[("rowwise input columns", 128)] == (64 * t, 64 * t + 64, 2)
        assert ranges[("embedding rows", 64)] == (32 * t, 32 * t + 32, 1)


def test_pipeline_ddp_ranks_hold_their_stage_whole(capsys: pytest.CaptureFixture[str],
                                                   work: Path) -> None:
    """pp x dp without tensor parallelism: each rank a whole copy of its stage."""
    capsys.readouterr()
    rc = main(["show", str(work / "pipe_ddp.yaml"), "--model", ref(work, "mlp"), *MLP,
               "--world", "4", "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    data = json.loads(out)
    mesh, stages = data["mesh"], data["summary"]["stages"]
    assert mesh["dims"] == {"pp": 2, "dp": 2}
    assert mesh["parameters"] == sum(s["parameters"] for s in stages) == (
        16 * 32 + 32 + 2 * (32 * 32 + 32) + 32 * 4 + 4)
    for r in mesh["ranks"]:
        c = r["coords"]
        assert r["rank"] == c["pp"] * 2 + c["dp"] and c["tp"] == 0
        assert r["holds"]["parameters"] == stages[c["pp"]]["parameters"]
        assert r["holds"]["tp_shard"] is None and r["holds"]["tp_ranges"] == []
        assert r["holds"]["fsdp2_chunk"] is None
    rc = main(["show", str(work / "pipe_ddp.yaml"), "--model", ref(work, "mlp"), *MLP,
               "--world", "4"])
    out, _ = capsys.readouterr()
    mesh_text = out[out.index("\nmesh: ") + 1:].splitlines()
    assert mesh_text[:2] == ["mesh: pp 2 x dp 2 on 4 ranks (rank = pp x 2 + dp)",
                             "  dp: ddp, so each dp replica holds a whole copy"]
    assert mesh_text[2].startswith("  rank 0 (pp 0, dp 0): stage 0 (")
    assert mesh_text[2].endswith(f"dp replica 0 of 2; holds {stages[0]['parameters']} of "
                                 f"{mesh['parameters']} params "
                                 f"({stages[0]['parameters'] / mesh['parameters']:.1%})")


# -- text and the picture ---------------------------------------------------------------------
def test_text_names_each_ranks_coordinates_stage_and_shard(work: Path, tmp_path: Path) -> None:
    """The text after the plan; with --graph html the mesh picture is written beside it."""
    page = tmp_path / "llama.html"
    rc, out, err = invoke("show", str(work / "tp_pp_fsdp.yaml"), "--model",
                          ref(work, "llama"), *LLAMA, "--world", "8", "--graph", "html",
                          "--out", str(page))
    assert rc == 0, err
    assert f"wrote {tmp_path / 'llama-mesh.svg'}" in err
    assert page.is_file() and (tmp_path / "llama-mesh.svg").is_file()
    assert out.index("tensor parallel:") < out.index("\nmesh: ")
    lines = out[out.index("\nmesh: ") + 1:].splitlines()
    assert lines[0] == "mesh: pp 2 x dp 2 x tp 2 on 8 ranks (rank = (pp x 2 + dp) x 2 + tp)"
    assert lines[1].startswith("  dp: fsdp2, so each rank keeps 1/2 of the rows")
    assert lines[2].startswith("  tp: 16 layer(s) sharded across each group of 2 ranks")
    five = lines.index(next(line for line in lines if line.startswith("  rank 5 ")))
    assert lines[five].startswith("  rank 5 (pp 1, dp 0, tp 1): stage 1 (")
    assert "dp replica 0 of 2; holds " in lines[five]
    assert lines[five + 1].startswith("      tp 1 of 2: colwise rows 16-31 of 32 (2 layers), "
                                      "32-63 of 64 (2 layers), 64-127 of 128 (2 layers); "
                                      "rowwise input columns 32-63 of 64 (1 layer), "
                                      "64-127 of 128 (1 layer)")
    assert lines[five + 2] == ("      fsdp2: keeps chunk 0 of 2 of the rows of each of those "
                               "parameters")
    # stage 0 holds the embedding (its rows by vocabulary), stage 1 does not
    assert "embedding rows 32-63 of 64 (1 layer)" in lines[lines.index(next(
        line for line in lines if line.startswith("  rank 1 "))) + 1]
    assert "embedding" not in lines[five + 1]
    assert sum(line.startswith("  rank ") for line in lines) == 8


def test_mesh_picture_has_a_box_per_rank(work: Path, eight: dict[str, Any]) -> None:
    """``<out stem>-mesh.svg``: valid SVG, one labelled box per rank, a frame per tp group,
    a label per dp replica, a header per pp column, the dims in the title."""
    path = work / "eight-mesh.svg"
    assert str(path) in eight["files"] and str(work / "eight.svg") in eight["files"]
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"

    def groups(cls: str) -> list[ET.Element]:
        return [g for g in root.iter(f"{SVG}g") if g.get("class") == cls]

    def texts(g: ET.Element) -> list[str]:
        return [t.text or "" for t in g.iter(f"{SVG}text")]

    boxes = groups("rank")
    assert len(boxes) == 8
    by_rank = {r["rank"]: r for r in eight["mesh"]["ranks"]}
    for box in boxes:
        r = by_rank[int(box.get("data-rank", "-1"))]
        c = r["coords"]
        assert (box.get("data-pp"), box.get("data-dp"), box.get("data-tp")) == (
            str(c["pp"]), str(c["dp"]), str(c["tp"]))
        assert box.get("data-stage") == str(c["pp"])
        assert box.get("data-parameters") == str(r["holds"]["parameters"])
        assert texts(box) == [f"rank {r['rank']}", f"pp {c['pp']} · dp {c['dp']} · tp {c['tp']}",
                              f"stage {c['pp']}",
                              f"{r['holds']['parameters']:,} params ({r['holds']['share']:.1%})"]
    frames = groups("tp-group")
    assert sorted(f.get("data-ranks") for f in frames) == ["0 1", "2 3", "4 5", "6 7"]
    assert [texts(g) for g in groups("dp-row")] == [["dp replica 0"], ["dp replica 1"]]
    assert [texts(g)[0] for g in groups("pp-column")] == ["pp 0 · stage 0", "pp 1 · stage 1"]
    assert texts(groups("title")[0])[0] == "mesh: pp 2 x dp 2 x tp 2 on 8 ranks"


# -- errors and the default -------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "world", "reason", "fix"), [
    ("tp_pp_fsdp.yaml", "6", "--world 6: tensor parallel: 6 ranks do not split into 2 stages "
     "x tensor_parallel.size 2", "launch a multiple of 4 processes"),
    ("tp.yaml", "4", "data_parallel.kind is none", "set data_parallel.kind: fsdp2"),
    ("pipe.yaml", "3", "--world 3: pipeline.schedule gpipe runs one stage per rank",
     "use --world 2, or set pipeline.stages: 3"),
    ("int8-qat", "2", "--world 2: the spec has no pipeline, data_parallel or tensor_parallel",
     "use --world 1"),
])
def test_a_world_the_spec_does_not_fit_is_one_line_and_its_fix(
        capsys: pytest.CaptureFixture[str], work: Path, spec: str, world: str, reason: str,
        fix: str) -> None:
    """Refused from the spec before the model is built (the factory would raise)."""
    path = str(work / spec) if spec.endswith(".yaml") else spec
    capsys.readouterr()
    rc = main(["show", path, "--model", ref(work, "broken"), *MLP, "--world", world])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and reason in lines[0], err
    assert lines[1].startswith("  fix: ") and fix in lines[1], err


@pytest.mark.parametrize("world", ["0", "-2", "two"])
def test_world_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str], work: Path,
                                          world: str) -> None:
    capsys.readouterr()
    rc = main(["show", str(work / "tp.yaml"), "--model", ref(work, "broken"), *MLP,
               "--world", world])
    _, err = capsys.readouterr()
    assert rc == 2 and "argument --world" in err, err


def test_without_world_nothing_changes(capsys: pytest.CaptureFixture[str], work: Path,
                                       tmp_path: Path) -> None:
    capsys.readouterr()
    rc = main(["show", str(work / "pipe_ddp.yaml"), "--model", ref(work, "mlp"), *MLP,
               "--format", "json", "--graph", "svg", "--layout", "python", "--out",
               str(tmp_path / "g.svg")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    data = json.loads(out)
    assert "mesh" not in data and data["files"] == [str(tmp_path / "g.svg")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.svg"]
