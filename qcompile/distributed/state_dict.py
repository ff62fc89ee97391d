"""``optimizer_state_dict``: torch.distributed.checkpoint's optimizer state of a compiled
graph, keyed by the model's own names, so that a run resumes with torch's
``set_state_dict``.

A graph compiled with ``data_parallel: fsdp2`` (or pipeline stages, in one process) holds
its blocks as ``stage_<i>`` child graphs; its ``state_dict`` uses the model's names, and
so do the model state ``get_model_state_dict`` returns and the names ``set_state_dict``
looks the optimizer's state up by. ``get_optimizer_state_dict`` alone names each
parameter's state by ``named_parameters()`` (``stage_0.model.norm.weight``), which
``set_state_dict`` then does not find. This function returns torch's dict with those
names made the model's (plain or ``flatten_optimizer_state_dict``); anything else is
torch's, unchanged. For a graph without block children it is torch's function.

Example:
    >>> from qcompile.distributed.state_dict import model_name
    >>> model_name("stage_1.model.layers.1.mlp.up_proj.weight", ("stage_0", "stage_1"))
    'model.layers.1.mlp.up_proj.weight'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.fx import GraphModule

__all__ = ["model_name", "optimizer_state_dict"]


def model_name(name: str, children: Sequence[str]) -> str:
    """``name`` without its leading block child (``stage_<i>.``), if it has one."""
    head, _, rest = name.partition(".")
    return rest if rest and head in children else name


def _children(model: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, c in model.named_children()
                 if n.startswith("stage_") and isinstance(c, GraphModule))


def optimizer_state_dict(model: nn.Module, optimizers: Any, *, options: Any = None) -> Any:
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model,
    optimizers, options=options)`` with each parameter's state under the model's name (see
    the module). Call it on every rank, as torch's (a collective under FSDP2).

    Example (on every rank; ``model`` from ``qc.distributed.wrap``):
        >>> import torch.distributed.checkpoint as dcp  # doctest: +SKIP
        >>> from torch.distributed.checkpoint.state_dict import (  # doctest: +SKIP
        ...     get_model_state_dict, set_state_dict)
        >>> state = {"model": get_model_state_dict(model),  # doctest: +SKIP
        ...          "optim": qc.distributed.optimizer_state_dict(model, opt)}
        >>> dcp.save(state, checkpoint_id="ckpt")  # doctest: +SKIP
        >>> # to resume: the same dict from the new model and optimizer, then
        >>> dcp.load(state, checkpoint_id="ckpt")  # doctest: +SKIP
        >>> set_state_dict(model, opt, model_state_dict=state["model"],  # doctest: +SKIP
        ...                optim_state_dict=state["optim"])
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizers, options=options)
    children = _children(model)
    if not children:
        return osd
    if "state" in osd and "param_groups" in osd and isinstance(osd["state"], dict):
        osd["state"] = {model_name(k, children): v for k, v in osd["state"].items()}
        for group in osd["param_groups"]:
            group["params"] = [model_name(k, children) for k in group["params"]]
        return osd
    out = {}  # flattened: "state.<name>.<key>", "param_groups.<name>.<key>"
    for key, value in osd.items():
        kind, _, rest = key.partition(".")
        out[f"{kind}.{model_name(rest, children)}" if rest else key] = value
    return out
