"""Adapters for the libraries qcompile is measured against, each set up with the recipe
closest to qcompile's: torch.fx ``symbolic_trace`` (the floor: tracing alone), torch.ao
``prepare_qat_fx`` (x86 default QAT qconfig), torch.ao ``prepare_fx`` + ``convert_fx``
(x86 default qconfig, calibrated), and, when installed, torchao's QAT (optional:
``pip install -e .[bench]``). Their warnings are silenced: they are not ours to fix.

Example:
    >>> import torch
    >>> from qcompile.tools.bench.competitors import has_torchao, prepare_qat_fx
    >>> gm = prepare_qat_fx(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4))
    >>> type(gm).__name__
    'GraphModule'
    >>> has_torchao() in (True, False)
    True
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def symbolic_trace(model: nn.Module) -> torch.fx.GraphModule:
    """Plain ``torch.fx.symbolic_trace``: the cost every fx-based compiler pays first."""
    return torch.fx.symbolic_trace(model)


def prepare_qat_fx(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """torch.ao's QAT prepare (x86 default qconfig mapping) of ``model`` in train mode."""
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx as ao_prepare_qat_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ao_prepare_qat_fx(model.train(), get_default_qat_qconfig_mapping("x86"), (x,))


def convert_fx(model: nn.Module, calib: Sequence[tuple[Any, ...]]) -> nn.Module:
    """torch.ao's ``prepare_fx`` (x86 default qconfig mapping) on ``model``, calibrated on
    ``calib`` (input tuples), then ``convert_fx``: its int8 inference graph."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx as ao_convert_fx
    from torch.ao.quantization.quantize_fx import prepare_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = prepare_fx(model, get_default_qconfig_mapping("x86"), calib[0])
        with torch.no_grad():
            for b in calib:
                ao(*b)
        return ao_convert_fx(ao)


def torchao_qat(model: nn.Module) -> nn.Module:
    """torchao's QAT prepare on ``model`` (in place) with the closest recipe to int8-qat:
    int8 per-channel symmetric weights, int8 per-token asymmetric activations. It swaps
    ``nn.Linear`` only (convolutions stay float). Needs torchao (``pip install .[bench]``)."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
        weight = IntxFakeQuantizeConfig(torch.int8, granularity="per_channel")
        quantize_(model, QATConfig(activation_config=act, weight_config=weight,
                                   step="prepare"))
    return model


def has_torchao() -> bool:
    return importlib.util.find_spec("torchao") is not None
