"""Hugging Face decoders on the GPU: every decoder family qcompile is checked on, compiled
with the LLM presets, trains on the device as on the CPU; a model that already lives on the
device compiles there; the frozen NF4 base of QLoRA trains its adapters there; and the
exports (GGUF, compressed-tensors checkpoints, peft adapters) of a graph on the device
write what the CPU's copy of the same graph writes.

The reference is always the CPU: the same compiled graph (a deep copy moved with
``.to(device)``) run on CPU tensors. Weights fake-quantize to the same bits on both
(``test_fake_quant_cuda.py``); activations are quantized from matmul outputs, which differ
in their last bits between the devices, so an activation element at a rounding boundary
can move by one quantization step: losses agree to 1e-3 and gradients to a few percent of
their norm, never bit for bit.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

import qcompile as qc

transformers = pytest.importorskip("transformers")
from qcompile.tools.architectures import ARCHITECTURES, DECODERS  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                         "ignore::FutureWarning", "ignore::UserWarning")]

# every decoder family with the int8-activation / int4-weight preset, and the dense and
# mixture-of-experts families with the other LLM presets (llama.cpp's grid, NVFP4, int8)
CASES = [(arch, "8da4w-qat") for arch in DECODERS] + [
    (arch, preset) for arch in ("llama", "mixtral", "qwen2_moe")
    for preset in ("gguf-q4_0-qat", "nvfp4-qat", "int8-qat")]


def build(arch: str) -> torch.nn.Module:
    """The family's tiny model with every dropout probability of its config at zero (the
    two devices draw different masks)."""
    a = ARCHITECTURES[arch]
    defaults = getattr(transformers, a.config)().to_dict()
    off = {k: 0.0 for k, v in defaults.items()
           if isinstance(v, float) and ("dropout" in k or "pdrop" in k)}
    return a.build(**off)


def on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def step(gm: torch.nn.Module, arch: str, batch: dict[str, torch.Tensor]) -> float:
    """One forward and backward; the loss."""
    loss = ARCHITECTURES[arch].loss(gm(**batch), batch)
    loss.backward()
    return loss.item()


def off_device(gm: torch.nn.Module, device: torch.device) -> list[str]:
    """Names of the parameters and buffers of ``gm`` not on ``device``."""
    return [n for n, t in [*gm.named_parameters(), *gm.named_buffers()]
            if t.device.type != device.type]


def assert_grads_close(dev: torch.nn.Module, cpu: torch.nn.Module, what: str,
                       share: float = 0.05) -> None:
    """Every gradient of ``dev`` within ``share`` of the CPU gradient's norm (plus a floor
    for gradients that are nearly zero), and the whole gradient vector's cosine with the
    CPU's above 0.999."""
    dev_grads = {n: p.grad for n, p in dev.named_parameters() if p.grad is not None}
    cpu_grads = {n: p.grad for n, p in cpu.named_parameters() if p.grad is not None}
    assert sorted(dev_grads) == sorted(cpu_grads), what
    dots = norm_d = norm_c = 0.0
    for name, gc in cpu_grads.items():
        gd = dev_grads[name].detach().float().cpu()
        gc = gc.detach().float().cpu()
        err = float((gd - gc).norm())
        ref = float(gc.norm())
        assert err <= share * ref + 1e-6, f"{what}: gradient of {name}: {err:.3g} vs {ref:.3g}"
        dots += float((gd * gc).sum())
        norm_d += float(gd.square().sum())
        norm_c += float(gc.square().sum())
    cosine = dots / math.sqrt(norm_d * norm_c)
    assert cosine > 0.999, f"{what}: gradient cosine {cosine:.6f}"


@pytest.mark.parametrize("arch, preset", CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_decoder_first_qat_step_matches_the_cpu(arch: str, preset: str,
                                                device: torch.device) -> None:
    a = ARCHITECTURES[arch]
    batch = a.batch()
    gm_cpu = qc.qcompile(build(arch), preset, example_kwargs=batch)
    gm_dev = copy.deepcopy(gm_cpu).to(device)
    assert off_device(gm_dev, device) == []
    loss_c = step(gm_cpu, arch, batch)
    loss_d = step(gm_dev, arch, on(batch, device))
    assert math.isclose(loss_c, loss_d, rel_tol=1e-3), (loss_c, loss_d)
    assert_grads_close(gm_dev, gm_cpu, f"{arch} {preset}")
    dev_q = qc.quantizers(gm_dev)
    for name, q in qc.quantizers(gm_cpu).items():
        assert dev_q[name].scale.device.type == device.type, name
        torch.testing.assert_close(dev_q[name].scale.cpu(), q.scale, rtol=1e-3, atol=1e-12,
                                   msg=lambda m, n=name: f"{arch} {preset} scale of {n}: {m}")


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_decoder_qat_trains_in_bf16_autocast(arch: str, device: torch.device) -> None:
    """Twelve AdamW steps on one batch under bf16 autocast: the loss falls, every
    parameter and qparam stays float32 on the device."""
    a = ARCHITECTURES[arch]
    batch = on(a.batch(), device)
    gm = qc.qcompile(build(arch), "gguf-q4_0-qat", example_kwargs=a.batch()).to(device)
    opt = torch.optim.AdamW(gm.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = a.loss(gm(**batch), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.8 * losses[0], losses
    for name, p in gm.named_parameters():
        assert p.dtype == torch.float32 and p.device.type == device.type, name
    for name, q in qc.quantizers(gm).items():
        assert q.scale.dtype == torch.float32 and q.scale.device.type == device.type, name


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_compiling_a_model_that_lives_on_the_device(arch: str, device: torch.device) -> None:
    """``qc.qcompile`` of a model already on the device with device inputs: the graph is
    on the device, the user's model is unchanged, and it computes what the CPU-compiled
    graph moved there computes."""
    a = ARCHITECTURES[arch]
    model = build(arch).to(device)
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    batch = on(a.batch(), device)
    gm = qc.qcompile(model, "8da4w-qat", example_kwargs=batch)
    assert off_device(gm, device) == []
    for name, t in model.state_dict().items():
        assert t.device.type == device.type and torch.equal(t, before[name]), name
    ref = qc.qcompile(build(arch), "8da4w-qat", example_kwargs=a.batch()).to(device)
    assert sorted(qc.quantizers(gm)) == sorted(qc.quantizers(ref))
    loss = step(gm, arch, batch)
    loss_ref = step(ref, arch, batch)
    assert math.isclose(loss, loss_ref, rel_tol=1e-4), (loss, loss_ref)
    assert_grads_close(gm, ref, f"{arch} compiled on the device", share=0.02)


def test_torch_compile_of_a_decoder_equals_eager(device: torch.device) -> None:
    """``torch.compile`` of a compiled Llama on llama.cpp's grid: the loss and gradients
    of eager (Inductor fuses the fake-quant into its own kernels)."""
    a = ARCHITECTURES["llama"]
    batch = on(a.batch(), device)
    gm = qc.qcompile(build("llama"), "gguf-q4_0-qat", example_kwargs=a.batch()).to(device)
    eager = copy.deepcopy(gm)
    loss_e = step(eager, "llama", batch)
    loss_c = step(torch.compile(gm), "llama", batch)
    assert math.isclose(loss_e, loss_c, rel_tol=1e-3), (loss_e, loss_c)
    assert_grads_close(gm, eager, "torch.compile vs eager")


def test_qlora_adapters_train_on_the_device(device: torch.device, tmp_path: Path) -> None:
    """The frozen NF4 base dequantizes on the device; a step's adapter gradients match the
    CPU's; the adapters saved from the device graph are the CPU graph's, bit for bit."""
    from safetensors.torch import load_file

    a = ARCHITECTURES["llama"]
    batch = a.batch()
    gm_cpu = qc.qcompile(build("llama"), "qlora-nf4", example_kwargs=batch)
    gm_dev = copy.deepcopy(gm_cpu).to(device)
    assert off_device(gm_dev, device) == []
    trained = {n for n, p in gm_dev.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained), sorted(trained)[:4]
    loss_c = step(gm_cpu, "llama", batch)
    loss_d = step(gm_dev, "llama", on(batch, device))
    assert math.isclose(loss_c, loss_d, rel_tol=1e-4), (loss_c, loss_d)
    assert_grads_close(gm_dev, gm_cpu, "qlora-nf4", share=0.02)
    with torch.no_grad():  # a step of the same size on both, then save
        for g in (gm_cpu, gm_dev):
            for p in g.parameters():
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=1e-3)
    for g, d in ((gm_cpu, "cpu"), (gm_dev, "dev")):
        qc.save_adapters(g, tmp_path / d)
    want = load_file(tmp_path / "cpu" / "adapter_model.safetensors")
    got = load_file(tmp_path / "dev" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    # an element whose gradient sign differs moves the other way: rare, at most 1%
    moved = sum(int((got[k] != want[k]).sum()) for k in want)
    total = sum(t.numel() for t in want.values())
    assert moved <= 0.01 * total, (moved, total)


def test_exports_of_a_graph_on_the_device(device: torch.device, tmp_path: Path) -> None:
    """GGUF (llama.cpp's Q4_0 grid) and a compressed-tensors checkpoint (8da4w) written
    from a graph on the device hold the same tensors, byte for byte, as those written from
    the graph's CPU copy."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file

    a = ARCHITECTURES["llama"]
    batch = a.batch()
    model = a.build()
    for preset in ("gguf-q4_0-qat", "8da4w-qat"):
        gm_cpu = qc.qcompile(model, preset, example_kwargs=batch).eval()
        with torch.no_grad():
            gm_cpu(**batch)  # observe once
        gm_dev = copy.deepcopy(gm_cpu).to(device)
        if preset.startswith("gguf"):
            paths = [qc.export_gguf(g, tmp_path / f"{d}.gguf", config=model.config)
                     for g, d in ((gm_cpu, "cpu"), (gm_dev, "dev"))]
            want, got = (gguf.GGUFReader(p).tensors for p in paths)
            assert [t.name for t in got] == [t.name for t in want]
            for t, w in zip(got, want):
                assert t.tensor_type == w.tensor_type, t.name
                assert bytes(t.data.tobytes()) == bytes(w.data.tobytes()), t.name
        else:
            dirs = [qc.save_pretrained(g, tmp_path / d, config=model.config)
                    for g, d in ((gm_cpu, "cpu"), (gm_dev, "dev"))]
            want, got = ({k: v for f in sorted(d.glob("*.safetensors"))
                          for k, v in load_file(f).items()} for d in dirs)
            assert sorted(got) == sorted(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
