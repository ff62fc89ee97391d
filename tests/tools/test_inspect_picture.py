"""``qcompile-inspect`` pictures, golden-tested at the level of their structure.

The SVG (pure-Python layout, no Graphviz) is parsed with ``xml.etree`` and its nodes,
clusters, fusion-group boxes and cut edges are compared with expected values for a small
CNN, a 2-stage pipeline (fp32 and int8 transfer) and a 32-block Llama-style transformer
(default depth, depth 1 / 2, focus); pictures are byte-identical across compiles, and the
layout never overlaps boxes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import qcompile as qc
from qcompile.errors import QCompileError
from qcompile.tools.inspect_cli import main
from qcompile.tools.inspect_picture import collapse, dot, graph, html, layout, svg

SVG = "{http://www.w3.org/2000/svg}"

RULES = [{"match": {"module": ["Conv2d", "Linear"]},
          "weight": {"dtype": "int8", "symmetric": True, "granularity": "per_channel"},
          "activation": {"dtype": "uint8", "symmetric": False}},
         {"match": {"op": ["add", "matmul"]}, "activation": {"dtype": "uint8", "symmetric": False},
          "optional": True}]


class Net(nn.Module):
    """conv-bn-relu (a fusion group), a residual add, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(x)))
        y = y + self.conv2(y)
        return self.fc(torch.flatten(self.pool(y), 1))


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        a = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.25, dim=-1)
        return self.o_proj(torch.matmul(a, v))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, 2 * d, bias=False)
        self.up_proj = nn.Linear(d, 2 * d, bias=False)
        self.down_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(d), Attention(d)
        self.post_attention_layernorm, self.mlp = RMSNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """A Llama-style decoder (names as in transformers), tiny widths."""

    def __init__(self, layers: int = 32, d: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm, self.lm_head = RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def compile_net() -> Any:
    torch.manual_seed(0)
    spec = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": RULES}})
    return qc.qcompile(Net().eval(), spec, (torch.randn(1, 3, 8, 8),))


def compile_pipeline(transfer: str) -> Any:
    spec = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": RULES[:1]},
                                          "pipeline": {"stages": 2, "transfer": transfer}})
    return qc.qcompile(mlp(), spec, (torch.randn(2, 16),))


@pytest.fixture(scope="module")
def llama_gm() -> Any:
    torch.manual_seed(0)
    spec = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": RULES}})
    return qc.qcompile(Llama(32).eval(), spec, (torch.randint(0, 32, (1, 8)),))


def picture(gm: Any, depth: int | str | None = None, focus: str | None = None
            ) -> tuple[graph.PictureGraph, str]:
    pg = graph.from_graph_module(gm)
    if depth == "auto":
        depth = collapse.auto_depth(pg)
    pg = collapse.collapse(pg, depth, focus, classes=graph.module_classes(gm))
    return pg, svg.to_svg(pg)


class Parsed:
    """What an SVG picture shows, read back from its markup."""

    def __init__(self, text: str) -> None:
        root = ET.fromstring(text)
        assert root.tag == f"{SVG}svg"
        self.nodes: dict[str, dict[str, Any]] = {}
        self.clusters: dict[str, str] = {}
        self.groups: dict[str, tuple[set[str], str]] = {}
        self.edges: list[dict[str, str]] = []
        for g in root.iter(f"{SVG}g"):
            cls = (g.get("class") or "").split()
            texts = ["".join(t.itertext()) for t in g.findall(f"{SVG}text")]
            if "node" in cls:
                rect = g.find(f"{SVG}rect")
                assert rect is not None
                self.nodes[g.get("data-id", "")] = {
                    "kind": g.get("data-kind"), "title": g.findtext(f"{SVG}title"),
                    "texts": texts, "box": tuple(float(rect.get(k, "0")) for k in
                                                 ("x", "y", "width", "height"))}
            elif "cluster" in cls:  # the label, whole in the tooltip (drawn on two lines)
                self.clusters[g.get("id", "")] = g.findtext(f"{SVG}title") or ""
                lines = [t.text or "" for t in g.iter(f"{SVG}tspan")]
                assert " · ".join(lines[:2]) == self.clusters[g.get("id", "")]
            elif "group" in cls:
                self.groups[g.get("id", "")] = (set(g.get("data-members", "").split()),
                                                texts[0] if texts else "")
            elif "edge" in cls:
                self.edges.append({**g.attrib, "label": texts[0] if texts else ""})

    def cut_edges(self) -> set[tuple[str, str, int, int, str]]:
        return {(e["data-src"], e["data-dst"], int(e["data-fp32-bytes"]), int(e["data-bytes"]),
                 e["data-transfer"]) for e in self.edges if "cut" in e["class"].split()}


def _no_overlaps(p: Parsed) -> None:
    boxes = sorted(p.nodes.items(), key=lambda kv: kv[1]["box"][0])
    for i, (a, na) in enumerate(boxes):
        ax, ay, aw, ah = na["box"]
        for b, nb in boxes[i + 1:]:
            bx, by, _, bh = nb["box"]
            if bx >= ax + aw:
                break
            assert not (by < ay + ah and ay < by + bh), f"{a} overlaps {b}"


# -- a small CNN ------------------------------------------------------------------------------
def test_cnn_nodes_groups_and_shapes() -> None:
    pg, text = picture(compile_net())
    p = Parsed(text)
    assert set(p.nodes) == {
        "x", "conv_weight_fake_quant", "conv2d", "bn", "relu", "conv_output_fake_quant",
        "conv2_weight_fake_quant", "conv2d_1", "conv2_output_fake_quant", "add",
        "add_fake_quant", "pool", "flatten", "fc_weight_fake_quant", "linear",
        "fc_output_fake_quant", "output"}
    # names once: each box shows its name one time, parameters are not boxes of their own
    titles = [n["texts"][0] for n in p.nodes.values()]
    assert len(titles) == len(set(titles))
    assert not any(t in ("conv_weight", "conv.weight") for t in titles)
    assert p.nodes["conv2d"]["texts"] == ["conv", "conv2d"]  # the layer, then the op
    assert p.nodes["conv_weight_fake_quant"]["kind"] == "quantizer"
    assert p.nodes["conv_weight_fake_quant"]["texts"][1].startswith("int8 per_channel")
    assert p.nodes["add_fake_quant"]["texts"][1].startswith("uint8 per_tensor")
    # the conv-bn-relu fusion group, boxed with its weight and output quantizers
    groups = {label: members for members, label in p.groups.values()}
    assert groups["fused conv+bn+relu"] == {"conv_weight_fake_quant", "conv2d", "bn", "relu",
                                            "conv_output_fake_quant"}
    assert {"conv2_weight_fake_quant", "conv2d_1", "conv2_output_fake_quant"} in [
        m for m, _ in p.groups.values()]  # a weighted op with its quantizers
    # edges carry shapes; no stage clusters without a pipeline
    labels = {(e["data-src"], e["data-dst"]): e["label"] for e in p.edges}
    assert labels[("x", "conv2d")] == "1x3x8x8"
    assert labels[("conv_weight_fake_quant", "conv2d")] == "8x3x3x3"
    assert p.clusters == {} and p.cut_edges() == set()
    _no_overlaps(p)
    # the details the HTML page shows for a weighted op and a quantizer
    details = {n.id: n.details for n in pg.nodes}
    assert details["conv2d"]["rule"] == "#0 module=Conv2d,Linear"
    assert details["conv2d"]["scheme"].startswith("weight int8 per_channel sym")
    assert set(details["fc_output_fake_quant"]) >= {"dtype", "granularity", "scale",
                                                    "zero_point"}


# -- a 2-stage pipeline -------------------------------------------------------------------------
@pytest.mark.parametrize("transfer, sent", [("fp32", 256), ("int8", 64 + 4 + 4)])
def test_pipeline_clusters_and_cut_edge(transfer: str, sent: int) -> None:
    gm = compile_pipeline(transfer)
    _, text = picture(gm)
    p = Parsed(text)
    stages = qc.report(gm).stages
    assert set(p.clusters) == {"cluster-stage0", "cluster-stage1"}
    for s in stages:
        label = p.clusters[f"cluster-stage{s.stage}"]
        assert label == (f"stage {s.stage} · cpu · cost {s.cost:.4g} · {s.parameters} params"
                         f" · in {s.bytes_in} B · out {s.bytes_out} B")
    # 2x32 float32 activations cross the cut: 256 bytes, or int8 payload + scale + zero point
    assert p.cut_edges() == {("s0._2_output_fake_quant", "s1.linear_2", 256, sent, transfer)}
    assert stages[0].bytes_out == sent
    cut = next(e for e in p.edges if "cut" in e["class"])
    assert cut["label"] == (f"int8 {sent} B (fp32 256 B) · 2x32" if transfer == "int8"
                            else "fp32 256 B · 2x32")
    # the transfer plumbing (pack / unpack, scale and zero-point slots) is folded in
    assert not any(k.split(".")[-1].startswith(("pack", "unpack")) for k in p.nodes)
    assert {n.split(".")[0] for n in p.nodes} == {"input_1", "s0", "s1", "output"}
    _no_overlaps(p)
    # the clusters do not overlap either: stage 1 is below or beside stage 0
    lay = svg.compute_layout(graph.from_graph_module(gm))
    (a,), (b,) = lay.clusters[0], lay.clusters[1]
    assert a[1] + a[3] <= b[1] or a[0] + a[2] <= b[0]


# -- a 32-block transformer -------------------------------------------------------------------
def test_transformer_default_depth_fits_a_screen(llama_gm: Any) -> None:
    pg = graph.from_graph_module(llama_gm)
    assert len(pg.nodes) > 1000
    assert collapse.auto_depth(pg) == 2
    shown, text = picture(llama_gm, "auto")
    p = Parsed(text)
    assert len(p.nodes) <= 60
    assert {f"layers.{i}" for i in range(32)} <= {n["texts"][0] for n in p.nodes.values()}
    block = p.nodes["mod:layers.7"]
    assert block["kind"] == "module" and block["texts"][1] == "Block · 46 nodes · 18 quant"
    _no_overlaps(p)
    lay = svg.compute_layout(shown)
    assert layout.overlaps(lay) == [] and lay.columns > 1  # wrapped to a screen's shape
    assert 0.8 < lay.width / lay.height < 3.0
    # every node (no collapsing) still lays out without overlaps
    full = svg.compute_layout(pg)
    assert layout.overlaps(full) == []


def test_transformer_depth_1_2_and_focus(llama_gm: Any) -> None:
    titles = {n["texts"][0] for n in Parsed(picture(llama_gm, 1)[1]).nodes.values()}
    assert titles == {"input_ids", "embed_tokens", "layers", "norm", "lm_head", "output"}
    p2 = Parsed(picture(llama_gm, 2)[1])
    assert {n["texts"][0] for n in p2.nodes.values()} == (
        {"input_ids", "embed_tokens", "norm", "lm_head", "output"}
        | {f"layers.{i}" for i in range(32)})
    focused = Parsed(picture(llama_gm, 2, focus="layers.3")[1])
    shown = {n["title"] for n in focused.nodes.values()}  # whole names (long ones are clipped)
    assert "layers.3" not in shown and {"layers.2", "layers.4"} <= shown
    assert {"layers.3.self_attn.q_proj", "layers.3.self_attn.q_proj.weight_fake_quant",
            "layers.3.mlp.down_proj"} <= shown
    # the focused block's weighted ops are boxed with their weight and output quantizers
    assert {"layers_3_self_attn_q_proj_weight_fake_quant", "linear_21",
            "layers_3_self_attn_q_proj_output_fake_quant"} in [m for m, _ in
                                                               focused.groups.values()]
    # a deeper focus shows the siblings of its ancestors as boxes
    deep = {n["title"] for n in Parsed(picture(llama_gm, 1, focus="layers.3.mlp")[1])
            .nodes.values()}
    assert {"layers.0", "layers.31", "layers.3.self_attn", "layers.3.input_layernorm",
            "layers.3.mlp.up_proj"} <= deep
    assert "layers" not in deep and "layers.3" not in deep


def test_export_front_end_collapses_the_same_way() -> None:
    """torch.export graphs name modules only in ``nn_module_stack``: same boxes."""
    torch.manual_seed(0)
    spec = qc.CompileSpec.model_validate({"quant": {"mode": "qat", "rules": RULES},
                                          "trace": {"method": "export"}})
    gm = qc.qcompile(Llama(2).eval(), spec, (torch.randint(0, 32, (1, 8)),))
    assert qc.report(gm).trace_method == "export"
    shown = {n["title"]: n["texts"][1:] for n in Parsed(picture(gm, 2)[1]).nodes.values()}
    assert set(shown) == {"input_ids", "embedding", "layers.0", "layers.1", "norm", "lm_head",
                          "output"}
    assert shown["layers.1"] == ["Block · 46 nodes · 18 quant"]
    assert shown["lm_head"] == ["Linear · 3 nodes · 2 quant"]


def test_bad_depth_and_focus_are_user_errors(llama_gm: Any) -> None:
    pg = graph.from_graph_module(llama_gm)
    with pytest.raises(QCompileError, match=r"--focus 'layers\.99'") as e:
        collapse.collapse(pg, 2, "layers.99")
    assert e.value.fix is not None and "layers" in e.value.fix
    for bad in ("0", "-1", "deep"):
        with pytest.raises(QCompileError, match="--depth") as e:
            collapse.parse_depth(bad)
        assert "--depth full" in (e.value.fix or "")
    assert collapse.parse_depth("3") == 3 and collapse.parse_depth("full") is None


# -- determinism ----------------------------------------------------------------------------------
def test_pictures_are_byte_identical_across_compiles() -> None:
    a, b = compile_pipeline("int8"), compile_pipeline("int8")
    pa, sa = picture(a)
    pb, sb = picture(b)
    assert sa == sb
    assert dot.to_dot(pa) == dot.to_dot(pb)
    assert html.to_html(pa, sa, info="x") == html.to_html(pb, sb, info="x")


def test_pictures_do_not_depend_on_hash_seed() -> None:
    """Another process with another string-hash seed draws the same bytes."""
    here = Path(__file__).parent
    code = ("import hashlib, sys; sys.path.insert(0, sys.argv[1]); "
            "import test_inspect_picture as t; "
            "print(hashlib.sha256(t.picture(t.compile_pipeline('int8'))[1].encode()).hexdigest())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    p = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True,
                       env=env, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    mine = hashlib.sha256(picture(compile_pipeline("int8"))[1].encode()).hexdigest()
    assert p.stdout.strip() == mine


def test_layout_handles_cycles_and_is_deterministic() -> None:
    ids = [f"n{i}" for i in range(12)]
    sizes = {n: (60.0 + 7 * (i % 3), 30.0) for i, n in enumerate(ids)}
    edges = [(ids[i], ids[j]) for i in range(12) for j in (i + 1, i + 3) if j < 12]
    edges.append(("n9", "n2"))  # against the order: laid out reversed, still drawn
    one = layout.layout(ids, sizes, edges)
    assert one == layout.layout(ids, sizes, edges)
    assert layout.overlaps(one) == [] and len(one.routes) == len(edges)
    assert all(len(r) >= 2 for r in one.routes)
    assert one.boxes["n0"][1] < one.boxes["n1"][1] < one.boxes["n4"][1]


# -- through the command line ---------------------------------------------------------------------
MODELS = textwrap.dedent("""
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.relu = nn.ReLU()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            y = self.relu(self.bn(self.conv(x)))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


    def net():
        torch.manual_seed(0)
        return Net().eval()
""")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pictures") / "picture_models.py"
    path.write_text(MODELS, encoding="utf-8")
    return path


def test_cli_flags_and_errors(capsys: pytest.CaptureFixture[str], model_file: Path,
                              tmp_path: Path) -> None:
    ref = f"{model_file}:net"
    base = ["show", "int8-qat", "--model", ref, "--input-shape", "1x3x8x8", "--format", "json"]
    capsys.readouterr()
    assert main([*base, "--graph", "svg", "--layout", "python", "--depth", "1",
                 "--out", str(tmp_path / "a.svg")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["picture"]["depth"] == 1 and data["picture"]["layout"] == "python"
    p = Parsed((tmp_path / "a.svg").read_text(encoding="utf-8"))
    assert {n["texts"][0] for n in p.nodes.values()} >= {"conv", "bn", "relu", "fc"}
    # the fused conv-bn-relu's output quantizer is boxed with the relu it follows (in the
    # conv's box it would draw an edge back up from the relu)
    assert p.nodes["mod:conv"]["texts"][1] == "Conv2d · 2 nodes · 1 quant"
    assert p.nodes["mod:relu"]["texts"][1] == "ReLU · 2 nodes · 1 quant"
    for flags, needle in ((["--depth", "0"], "--depth '0'"), (["--focus", "nope"],
                                                               "--focus 'nope'")):
        capsys.readouterr()
        assert main([*base, "--graph", "html", "--out", str(tmp_path / "b.html"), *flags]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"error: {needle}") and "\n  fix: " in err


def test_cli_sqnr_html_colours_layers(capsys: pytest.CaptureFixture[str], model_file: Path,
                                      tmp_path: Path) -> None:
    capsys.readouterr()
    rc = main(["sqnr", "int8-static", "--model", f"{model_file}:net", "--input-shape",
               "2x3x8x8", "--random", "2", "--graph", "html", "--out",
               str(tmp_path / "sqnr.html"), "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    data = json.loads(out)
    assert data["files"] == [str(tmp_path / "sqnr.html")]
    page = (tmp_path / "sqnr.html").read_text(encoding="utf-8")
    svg_text = page[page.index("<svg"):page.index("</svg>") + 6]
    root = ET.fromstring(svg_text)
    coloured = {g.get("data-id"): float(g.get("data-sqnr", "nan")) for g in root.iter(f"{SVG}g")
                if g.get("data-sqnr") is not None}
    measured = {r["node"]: r["sqnr_db"] for r in data["layers"]}
    assert coloured and len(coloured) >= len(measured)
    assert round(coloured["relu"], 2) == round(measured["relu"], 2)  # conv-bn-relu's output
    assert "SQNR 10 dB" in page  # the legend
    blob = page[page.index('id="qc-data">') + 13:]
    details = json.loads(blob[:blob.index("</script>")])
    assert dict(details["relu"]["details"])["sqnr"].endswith(" dB")
