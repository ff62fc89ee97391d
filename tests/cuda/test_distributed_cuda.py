"""Distributed and deployment paths on the GPU, in one process: FSDP2 ``fully_shard`` and
``compile_once`` over NCCL at world size 1, pipeline stages placed on the GPU by the spec,
and ``qc.convert`` / ``qc.export_onnx`` of a graph that lives on the GPU."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qcompile as qc

pytestmark = pytest.mark.cuda

D_IN, WIDTH, D_OUT = 16, 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.ln(x)))


class Model(nn.Module):
    """An input Linear, two residual blocks (compile_once's FSDP2 groups), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D_IN, WIDTH)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def spec_of(preset: str, data_parallel: str = "none", **extra) -> dict:
    spec = qc.load_spec(preset).model_dump()
    spec["data_parallel"] = {"kind": data_parallel}
    spec.update(extra)
    return spec


def batch(seed: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x[:, :D_OUT] - x[:, D_OUT:2 * D_OUT]).argmax(1)


def train(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def by_name(named) -> dict[str, torch.Tensor]:
    """name -> tensor, with the ``stage_<i>.`` prefix of a graph split into FSDP2 groups or
    pipeline stages left out (the names of the model's own modules)."""
    return {re.sub(r"^stage_\d+\.", "", n): t for n, t in named}


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (world 1: the local shard), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_fully_shard_with_nccl_trains_like_one_process(world_of_one: str,
                                                       device: torch.device) -> None:
    """``qc.distributed.wrap`` with ``data_parallel: fsdp2`` (``fully_shard`` on a world of
    one, observers synchronised over the process group): the same losses and weights as
    the unwrapped graph trained on the same device."""
    from torch.distributed.fsdp import FSDPModule

    spec = spec_of("int8-qat", "fsdp2")
    data = [tuple(t.to(device) for t in batch(s)) for s in range(4)]
    gm = qc.qcompile(Model(), spec, example_inputs=(data[0][0][:2],)).to(device)
    ref = qc.qcompile(Model(), spec, example_inputs=(data[0][0][:2],)).to(device)
    wrapped = qc.distributed.wrap(gm, spec)
    assert any(isinstance(m, FSDPModule) for m in wrapped.modules())
    got, want = train(wrapped, data), train(ref, data)
    for a, b in zip(got, want):
        assert math.isclose(a, b, rel_tol=1e-5), (got, want)
    ref_params = by_name(ref.named_parameters())
    for name, p in by_name(wrapped.named_parameters()).items():
        value = full(p.detach())
        assert value.device.type == device.type, name
        torch.testing.assert_close(value, ref_params[name].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    got_q = by_name(qc.quantizers(wrapped).items())
    for name, q in by_name(qc.quantizers(ref).items()).items():
        torch.testing.assert_close(full(got_q[name].scale), q.scale, rtol=1e-6, atol=0,
                                   msg=lambda m, n=name: f"scale of {n}: {m}")


def _calibrated_reference(preset: str, batches: list[torch.Tensor],
                          device: torch.device) -> nn.Module:
    ref = qc.qcompile(Model(), spec_of(preset), example_inputs=(batches[0][:2].cpu(),))
    return qc.calibrate(ref.to(device), batches, progress=False)


def test_compile_once_sharded_with_nccl(world_of_one: str, device: torch.device) -> None:
    """``compile_once`` with ``fsdp2`` over NCCL: the graph built on the meta device,
    sharded, loaded on the GPU and calibrated there computes what one process's compile +
    calibrate computes on the same device."""
    batches = [batch(10 + i)[0].to(device) for i in range(3)]
    gm = qc.distributed.compile_once(Model, spec_of("int8-static", "fsdp2"),
                                     (batches[0][:2].cpu(),), calibration=batches)
    ref = _calibrated_reference("int8-static", batches, device)
    for name, p in gm.named_parameters():
        assert full(p.detach()).device.type == device.type, name
    x = batch(20)[0].to(device)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), ref(x), rtol=1e-5, atol=1e-6)
    got_q = by_name(qc.quantizers(gm).items())
    for name, q in by_name(qc.quantizers(ref).items()).items():
        torch.testing.assert_close(full(got_q[name].scale), q.scale, rtol=1e-6, atol=0,
                                   msg=lambda m, n=name: f"scale of {n}: {m}")


def test_compile_once_replicated_with_nccl(world_of_one: str, device: torch.device) -> None:
    """``compile_once`` with ``ddp``: every rank builds the graph on the meta device and
    rank 0 streams each tensor through NCCL; the graph lives on the backend's device (the
    rank's GPU) and, calibrated there, equals a plain compile + calibrate on that device."""
    batches = [batch(30 + i)[0].to(device) for i in range(3)]
    gm = qc.distributed.compile_once(Model, spec_of("int8-static", "ddp"),
                                     (batches[0][:2].cpu(),), calibration=batches)
    assert {p.device.type for p in gm.parameters()} == {device.type}
    ref = _calibrated_reference("int8-static", batches, device)
    x = batch(40)[0].to(device)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), ref(x), rtol=1e-5, atol=1e-6)
    got_q = qc.quantizers(gm)
    for name, q in qc.quantizers(ref).items():
        torch.testing.assert_close(got_q[name].scale, q.scale, rtol=1e-6, atol=0,
                                   msg=lambda m, n=name: f"scale of {n}: {m}")


@pytest.mark.parametrize("layout", ["cpu_then_device", "device_only", "listed_int8"])
def test_pipeline_stages_placed_on_the_device(layout: str, device: torch.device) -> None:
    """``pipeline`` in the spec puts each stage on its device; forward and backward run in
    one process and agree with the graph compiled without a pipeline (on the CPU)."""
    dev = str(device)  # "cuda:0"
    pipeline = {
        "cpu_then_device": {"stages": 2, "devices": ["cpu", dev]},
        "device_only": {"stages": 2, "devices": [dev, dev]},
        "listed_int8": {"stages": [{"modules": ["inp", "layers.0*"], "device": dev},
                                   {"modules": ["layers.1*", "head"], "device": "cpu"}],
                        "transfer": "int8"},
    }[layout]
    x, y = batch(50)
    gm = qc.qcompile(Model(), spec_of("int8-qat", pipeline=pipeline), example_inputs=(x[:2],))
    ref = qc.qcompile(Model(), spec_of("int8-qat"), example_inputs=(x[:2],))
    devices = ([s["device"] for s in pipeline["stages"]] if isinstance(pipeline["stages"], list)
               else pipeline["devices"])
    for i, d in enumerate(devices):
        stage = gm.get_submodule(f"stage_{i}")
        assert {p.device for p in stage.parameters()} == {torch.device(d)}, (i, d)
    if pipeline.get("transfer") == "int8":  # integers carry no gradient: forward only
        with torch.no_grad():
            gm(x.to(devices[0]))  # the quantizers observe, as ref's do below
            ref(x)
            out, want = gm(x.to(devices[0])), ref(x)
        assert out.device == torch.device(devices[-1])
        # the value crossing the cut is sent as the integers of its quantizer (which the
        # fake-quant graph rounds to already): the same result
        torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-5)
        return
    out, want = gm(x.to(devices[0])), ref(x)
    assert out.device == torch.device(devices[-1])
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-5)
    F.cross_entropy(out, y.to(out.device)).backward()
    F.cross_entropy(want, y).backward()
    grads = by_name((n, p.grad) for n, p in gm.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].cpu(), p.grad, rtol=1e-3, atol=1e-5,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")


def _trained_qat_graph(device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    x, y = batch(60, 64)
    gm = qc.qcompile(Model(), "int8-qat", example_inputs=(x[:2],)).to(device)
    train(gm, [(x.to(device), y.to(device))] * 5)
    qc.freeze(gm)
    return gm.eval(), x.to(device)


def test_convert_a_graph_on_the_device(device: torch.device) -> None:
    """``qc.convert`` of a QAT graph on the GPU: integer weights (no CPU integer kernels
    there), and outputs within one output quantization step of the fake-quant graph, as
    on the CPU."""
    gm, x = _trained_qat_graph(device)
    int8 = qc.convert(gm, example_inputs=(x,))
    rep = qc.report(int8)
    assert rep.max_deviation, "convert compared the two graphs on the example inputs"
    steps = {k: v for k, v in rep.max_deviation.items() if k.endswith("_steps")}
    assert steps and all(v <= 1.0 + 1e-6 for v in steps.values()), rep.max_deviation
    with torch.no_grad():
        out = int8(x)
        assert out.device.type == device.type
        torch.testing.assert_close(out, gm(x), rtol=0, atol=float(rep.max_deviation["output0"]))


def test_export_onnx_of_a_graph_on_the_device(device: torch.device, tmp_path: Path) -> None:
    """``qc.export_onnx`` of a QAT graph that lives on the GPU, with GPU example inputs:
    a QDQ model that onnxruntime (CPU) runs, matching the graph within a few steps."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    gm, x = _trained_qat_graph(device)
    path = qc.export_onnx(gm, tmp_path / "model.onnx", example_inputs=(x,))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.cpu().numpy()})
    with torch.no_grad():
        want = gm(x).cpu()
    step = float(qc.quantizers(gm)[_output_quantizer(gm)].scale[0])
    assert float((torch.from_numpy(got) - want).abs().max()) <= 3 * step + 1e-6


def _output_quantizer(gm: nn.Module) -> str:
    """The name of the quantizer that produces the graph's output."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    node = out.args[0]
    assert node.op == "call_module", node
    return str(node.target)
