"""``qcompile.runtime.sharded`` in one process: NVFP4 of a shard under the whole tensor's
scale (the kernel given one more row) equals the formula bit for bit; ``ShardedLinear``
computes what the compiled graph computes. The quantizers on real DTensor shards are in
tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from qcompile.runtime import sharded
from qcompile.runtime.block_formats import _blocks, block_scales
from qcompile.runtime.fake_quant import FakeQuantize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 32), (2, 8, 48), (3, 16)])
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e4])
def test_nvfp4_shard_under_the_whole_tensors_scale(dtype, shape, scale) -> None:
    g = torch.Generator().manual_seed(hash((shape, scale)) % 2**31)
    x = (torch.randn(*shape, generator=g) * scale).to(dtype)
    other = (torch.randn(*shape, generator=g) * scale * 3).to(dtype)  # another rank's shard
    amax = torch.maximum(x.abs().amax(), other.abs().amax()).float()
    got = sharded._nvfp4(x.requires_grad_(), 16, amax)
    rows = _blocks(x.detach().reshape(-1, shape[-1]).float(), 16)
    ref = block_scales(rows, "nvfp4", tensor_scale=amax / (448 * 6)).fake_quant(rows)
    ref = ref.reshape(shape).to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.detach().view(bits), ref.view(bits))
    got.sum().backward()  # straight through
    assert torch.equal(x.grad, torch.ones_like(x))


def test_sharded_linear_runs_its_quantizers() -> None:
    torch.manual_seed(0)
    holder = torch.nn.Linear(32, 8)
    holder.weight_fake_quant = FakeQuantize("int4", granularity="per_group", group_size=16,
                                            symmetric=True, weight=True, channels=16)
    holder.input_fake_quant = FakeQuantize("int8", granularity="per_token", dynamic=True)
    x = torch.randn(4, 32)
    want = torch.nn.functional.linear(holder.input_fake_quant(x),
                                      holder.weight_fake_quant(holder.weight), holder.bias)
    layer = sharded.ShardedLinear.adopt(holder, quantize_weight=True, quantize_input=True)
    assert isinstance(layer, torch.nn.Linear) and layer.weight is holder.weight
    assert sorted(layer.state_dict()) == sorted(holder.state_dict())
    assert torch.equal(layer(x), want)
    plain = sharded.ShardedLinear.adopt(holder, quantize_weight=False, quantize_input=False)
    assert torch.equal(plain(x), torch.nn.functional.linear(x, holder.weight, holder.bias))
