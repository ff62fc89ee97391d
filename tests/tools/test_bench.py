"""qcompile-bench --quick runs (smoke tests: the numbers are reported, never asserted)."""

from __future__ import annotations

import json
import math

import pytest

from qcompile.tools.bench import main

# the suites' numbers are not asserted: one intra-op thread, as a second one only adds its
# synchronisation to the smoke runs' small tensors (many times the work on a busy machine)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("suite", ["fakequant", "compile", "step", "convert"])
def test_quick_suite_prints_json(capsys: pytest.CaptureFixture[str], suite: str) -> None:
    assert main([suite, "--quick", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    if suite == "fakequant":
        assert data["copy_GBps"] > 0
        for case in ("per_tensor", "per_channel", "per_group", "lsq"):
            assert data[case]["qcompile_fwd_GBps"] > 0 and data[case]["qcompile_fwd_bwd_GBps"] > 0
        assert "speedup_fwd" in data["per_tensor"] and "speedup_fwd" in data["per_channel"]
    elif suite == "step":
        for model in ("mlp", "cnn", "transformer"):
            for row in (data[model], data[f"{model}_steady_heap"]):  # the second: a process
                assert row["qcompile_vs_fp32"] > 0 and row["fp32_s"] > 0  # of its own
                assert row["fp32_faults"] >= 0 and row["qcompile_faults"] >= 0
    elif suite == "convert":
        for case in ("mlp_b64", "mlp_b1", "cnn_b32"):
            assert data[case]["kernels"] >= 4, "every layer reads integers"
            assert data[case]["qcompile_speedup"] > 0 and data[case]["convert_fx_speedup"] > 0
    else:
        for model in ("mlp", "cnn", "transformer"):
            row = data[model]
            assert row["qcompile_s"] > 0 and row["symbolic_trace_s"] > 0
            assert row["prepare_qat_fx_s"] > 0
            assert row["rewrite_floor_s"] > 0 and row["qcompile_vs_floor"] > 0
            assert row["export_module_vs_export"] > 0
        assert set(data["scaling_s"]) == {"50", "100"}


@pytest.mark.e2e
def test_quick_onnx_suite(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    assert main(["onnx", "--quick", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for case in ("mlp_b64", "mlp_b1", "cnn_b32"):
        row = data[case]
        assert row["qdq_onnx_ms"] > 0 and row["fp32_onnx_ms"] > 0 and row["qc_convert_ms"] > 0
        assert row["integer_kernels"] >= 4, "onnxruntime fused the QDQ groups"
        assert row["size_vs_fp32"] <= 0.30
        # onnxruntime requantizes per layer with its own rounding: a 1-step difference in
        # one layer can become 2 a few layers on (rarely); a broken export is off by many
        assert row["max_dev_output_steps"] <= 3.001


def test_onnx_suite_without_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from qcompile.tools.bench.suites.onnx import bench_onnx

    real = importlib.import_module

    def no_onnxruntime(name: str, *args: object) -> object:
        if name == "onnxruntime":
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_onnxruntime)
    assert "pip install qcompile[onnx]" in bench_onnx(quick=True)["note"]


def test_unknown_suite_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["nope"])
    assert info.value.code == 2


def test_format_json_parses_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fakequant", "--quick", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["copy_GBps"] > 0 and data["per_tensor"]["qcompile_fwd_GBps"] > 0
    assert "qcompile_inspect" not in data  # bench JSON is the result dict as it was


def test_json_flag_is_format_json() -> None:
    from qcompile.tools.bench import parser

    assert parser().parse_args(["step", "--json"]).format == "json"
    assert parser().parse_args(["step", "--format", "json"]).format == "json"
    assert parser().parse_args(["step"]).format == "text"


def test_text_and_json_come_from_one_sink(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch through SUITES, rendered by qcompile.tools.output (a stand-in suite, so
    nothing is measured)."""
    from qcompile.tools.bench import SUITES, Suite

    result = {"mlp": {"qcompile_s": 0.012345, "kernels": 4, "label": "x"}, "ratio": 2.5,
              "note": "torchao not installed"}
    monkeypatch.setitem(SUITES, "step", Suite(lambda quick: result))
    assert main(["step", "--quick"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mlp: qcompile_s 0.0123, kernels 4", "ratio: 2.5", "note: torchao not installed"]
    assert main(["step", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == result


@pytest.mark.e2e
def test_hybrid_counts_traffic_per_layout(capsys: pytest.CaptureFixture[str]) -> None:
    """4 ranks per layout: gradient buckets only with replicas, observer sync in one
    collective per step and rank (the step's minima and maxima together; DDP replicas
    agree on their weights) over each stage's replicas, sends only between stages; 2 x 2
    replicas hold half the model each, so half dp4's gradients."""
    assert main(["hybrid", "--quick", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    hybrid, dp4, pp4 = data["2x2"], data["dp4"], data["pp4"]
    assert hybrid["all_reduce"] == dp4["all_reduce"] == 1 * 4
    assert pp4["all_reduce"] == 0 and pp4["grad_buckets"] == 0
    assert dp4["p2p_sends"] == 0 and hybrid["p2p_sends"] > 0 and pp4["p2p_sends"] > 0
    assert 0 < hybrid["grad_bytes"] < dp4["grad_bytes"]
    assert hybrid["all_reduce_bytes"] < dp4["all_reduce_bytes"]
    assert all(row["step_s"] > 0 for row in data.values())


@pytest.mark.e2e
def test_compile_once_shards_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    """1 and 2 ranks, tiny model: every rank's peak is recorded and every variant ends
    FSDP2-sharded (each rank holds 1/N of the parameters); in the stream variant only
    rank 0 builds the real model (every other rank builds on meta, once)."""
    assert main(["compile-once", "--quick", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {(row["world"], row["variant"]): row for row in data["rows"]}
    assert set(rows) == {(n, v) for n in (1, 2)
                         for v in ("checkpoint", "stream", "naive", "calibrated")}
    for (world, variant), row in rows.items():
        assert len(row["peaks_mb"]) == world and all(p >= 0 for p in row["peaks_mb"])
        assert all(phases and phases[-1][0] == ("sharded" if variant == "naive" else "returned")
                   for phases in row["phases"])
        assert row["bound_mb"] > data["model_mb"] / world
        for local in row["local_param_mb"]:
            assert abs(local - data["model_mb"] / world) <= 0.01 * data["model_mb"], (
                world, variant, local)
    builds = [[p[0] for p in rank].count("built") for rank in rows[2, "stream"]["phases"]]
    assert builds == [2, 1], builds  # rank 0: meta + real; rank 1: meta only
    for rank in rows[2, "checkpoint"]["phases"]:
        assert [p[0] for p in rank].count("built") == 1  # meta only, on every rank


def test_algorithms_lm_data_is_deterministic_and_the_model_compiles() -> None:
    import torch

    import qcompile as qc
    from qcompile.tools.bench import lm
    from qcompile.tools.bench.suites.algorithms import CONFIGS, spec

    cfg = lm.LMConfig(layers=1, dim=32, heads=2, hidden=64, context=16, train_chars=30_000,
                      val_chars=2_000)
    a, b = lm.load_text(cfg), lm.load_text(cfg)
    assert a.vocab == b.vocab and torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.vocab[0] == "<unk>" and len(a.train) == 30_000 and len(a.val) == 2_000
    model = lm.TinyLlama(cfg, len(a.vocab)).eval()
    calib = lm.batches(a.train, cfg.context, 4, 2, seed=0)
    for config in CONFIGS:
        gm = qc.qcompile(model, spec("LM", config, []), example_inputs=(calib[0],))
        qc.calibrate(gm, calib, progress=False)
        assert lm.perplexity(gm, a.val, cfg.context) < 2 * len(a.vocab)


def test_algorithms_lm_weights_are_cached(tmp_path: object,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from qcompile.tools.bench import lm

    monkeypatch.setenv("QCOMPILE_BENCH_CACHE", str(tmp_path))
    cfg = lm.LMConfig(layers=1, dim=16, heads=2, hidden=32, context=16, train_chars=20_000,
                      val_chars=1_000, steps=2, batch=2, warmup=1)
    data = lm.load_text(cfg)
    first, info = lm.trained(cfg, data)
    again, info2 = lm.trained(cfg, data)
    assert not info["cached"] and info2["cached"] and info["path"] == info2["path"]
    assert all(v.equal(again.state_dict()[k]) for k, v in first.state_dict().items())


def test_quick_algorithms_suite(capsys: pytest.CaptureFixture[str], tmp_path: object,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QCOMPILE_BENCH_CACHE", str(tmp_path))  # trains its tiny LM afresh
    assert main(["algorithms", "--quick", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for model in ("MLP", "LM"):
        rows = data[model]["methods"]
        assert set(data[model]["configs"]) == {"w4 g32", "w8a8"}
        assert isinstance(rows["round-to-nearest"]["w8a8"]["value"], float)
        assert rows["round-to-nearest"]["w8a8"]["s"] > 0
    assert "smoothquant" in data["LM"]["methods"]
    assert "cross_layer_equalization" in data["MLP"]["methods"]


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_rewrite_floor_rebuilds_the_compiled_graph(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile suite's floor does the work it claims on the suite's own models: the
    graph it returns is qcompile's, node for node, and computes the same; it observes
    every weight quantizer it builds; and it leaves the model alone."""
    import torch

    import qcompile as qc
    from qcompile.runtime.fake_quant import FakeQuantize
    from qcompile.tools.bench import floors
    from qcompile.tools.bench.models import workloads

    make, x = workloads(True)[name]
    torch.manual_seed(0)
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spec = qc.load_spec("int8-qat")
    gm = qc.qcompile(model, spec, (x,))
    observed: list[FakeQuantize] = []
    real = FakeQuantize.observe_tensor

    def observe(fq: FakeQuantize, t: torch.Tensor) -> None:
        observed.append(fq)
        real(fq, t)

    monkeypatch.setattr(FakeQuantize, "observe_tensor", observe)
    floor = floors.rewrite_floor(model, x, gm, spec)
    monkeypatch.undo()
    rows = [(n.op, str(n.target), str(n.args)) for n in gm.graph.nodes]
    assert [(n.op, str(n.target), str(n.args)) for n in floor.graph.nodes] == rows
    weights = [r for r in qc.report(gm).quantizers if r.role == "weight"]
    assert len(observed) == len(weights) > 0
    for fq, rec in zip(observed, weights):
        torch.testing.assert_close(fq.scale, gm.get_submodule(rec.name).scale)
    torch.testing.assert_close(floor.eval()(x), gm.eval()(x))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _train_row(world: int, variant: str, peak: float, saved: float,
               vs_float: float) -> dict[str, object]:
    return {"mmap_threshold": None, "world": world, "variant": variant,
            "total_peak_mb": [peak + r for r in range(world)], "peak_mb": [peak / 10] * world,
            "after_mb": [0.5] * world, "saved_mb": [saved] * world,
            "setup_mb": [1.0] * world, "warm_mb": [2.0] * world,
            "local_param_mb": [1.0 / world] * world,
            "vs_float": vs_float, "ok": vs_float <= 1.1}


def test_memory_text_says_the_training_step_rows() -> None:
    """The memory suite's text on a fabricated quick result (1 and 2 ranks, 1 MB model):
    the compile rows as records, then one table line per (N, variant) with every rank's
    peak, the ratio to the float step and whether it is within 10%; the weights-kept
    row's note when the spec refused it."""
    from qcompile.tools.bench.suites.compile import memory_text
    from qcompile.tools.bench.train_memory import TRAIN_VARIANTS

    rows = []
    for world in (1, 2):
        rows += [_train_row(world, "float", 40.0, 0.1, 1.0),
                 _train_row(world, "qat", 42.0, 0.1, 1.05),
                 _train_row(world, "naive", 90.0, 1.2, 2.25)]
    result = {"qcompile": {"peak_mb": 900.0, "net_mb": 500.0},
              "qcompile_vs_prepare_qat_fx": 0.9,
              "train_step": {"model_mb": 1.0, "blocks": 4, "width": 256, "batch": 8,
                             "rows": rows, "note": "weights kept: not measured"}}
    lines = memory_text(result).splitlines()
    assert lines[:2] == ["qcompile: peak_mb 900, net_mb 500", "qcompile_vs_prepare_qat_fx: 0.9"]
    assert lines[2].startswith("training step under FSDP2") and "1 MB model of 4 blocks" in lines[2]
    assert lines[3] == "glibc malloc defaults:"
    table = [line.split() for line in lines[5:-1]]
    assert len(table) == 6 and lines[-1] == "weights kept: not measured"
    for cells, row in zip(table, rows):
        assert cells[0] == str(row["world"])
        assert " ".join(cells).startswith(f"{row['world']} {TRAIN_VARIANTS[row['variant']]} ")
    two_ranks_qat = " ".join(table[4])
    assert two_ranks_qat.endswith(" 42 / 43 1.05 yes 4 0 0")  # step 4.2, after 0.5, kept 0.1
    assert " 2.25 no " in " ".join(table[5])


def test_saved_bytes_counts_each_storage_once_as_it_is_after_forward() -> None:
    """The training-step rows' allocator-independent number: views of one storage count
    once, and a storage resized to 0 before the forward returns (as FSDP2 frees an
    unsharded weight) counts 0."""
    import torch

    from qcompile.tools.bench.train_memory import saved_bytes

    w = torch.randn(16, 32, requires_grad=True)
    x = torch.randn(4, 16)

    def forward() -> torch.Tensor:
        h = x @ w  # keeps x (256 B): w needs a gradient, x none
        return (h[:, :16] * h[:, 16:]).sum()  # both halves views of h's storage (512 B)

    out, kept = saved_bytes(forward)
    assert kept == 4 * 16 * 4 + 4 * 32 * 4
    out.backward()  # what was saved still serves backward
    assert w.grad is not None and w.grad.shape == w.shape

    freed = torch.randn(64, 64)

    def forward_freeing() -> torch.Tensor:
        y = (w.sum() * freed).sum()  # keeps freed (16 KiB)
        freed.untyped_storage().resize_(0)
        return y

    assert saved_bytes(forward_freeing)[1] == 0


@pytest.mark.e2e
def test_quick_llm_deploy_measures_inside_llama_cpp(capsys: pytest.CaptureFixture[str],
                                                     tmp_path, monkeypatch) -> None:
    """The whole --deploy flow on the quick LMs, dense (as Llama) and MoE (as Mixtral):
    llama.cpp evaluates the F32 file as torch does, and qcompile's RTN on the Q4_0 grid
    exports the very tensors llama.cpp's own quantizer writes (so the same perplexity)."""
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("QCOMPILE_BENCH_CACHE", str(tmp_path))
    assert main(["llm", "--deploy", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for kind, arch in (("dense", "LlamaForCausalLM"), ("moe", "MixtralForCausalLM")):
        r = result[kind]
        assert r["architecture"] == arch
        assert r["hf_vs_bench_lm_max_abs"] < 1e-4
        assert math.isclose(r["fp32"], r["fp32_torch"], rel_tol=1e-3)
        q4_0, q4_k = r["grids"]["q4_0"], r["grids"]["q4_k"]
        # per block q, k, v, o and the three MLP (or fused expert) tensors, and the head;
        # the routers stay F32
        assert q4_0["quantized_tensors"] == q4_k["quantized_tensors"] == \
            7 * r["config"]["layers"] + 1
        assert q4_0["rtn_tensors_identical"] == 1.0
        assert q4_0["rtn"] == q4_0["llama_cpp"]
        for row in (q4_0, q4_k):
            assert len(row["qat"]) == len(row["gptq_qat"]) == 1
        for row, g in ((q4_0, "Q4_0"), (q4_k, "Q4_K")):
            assert 4.0 < row["bits_per_param"][f"llama.cpp {g}"] < r["bits_per_param"]["fp32"]


def test_deploy_is_for_the_llm_suite_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["onnx", "--deploy"])
    assert "--deploy applies to the llm suite, not onnx" in capsys.readouterr().err
