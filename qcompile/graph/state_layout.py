"""Keep a compiled graph's ``state_dict`` layout equal to the model's.

``GraphModule(root, graph)`` copies only the attributes the graph reads, and registers
every buffer it copies as persistent. So a tied parameter known under two names (GPT-2's
``lm_head.weight`` / ``transformer.wte.weight``) loses one, parameters of modules the
forward never calls vanish, and non-persistent buffers (``position_ids``, ``inv_freq``)
appear in the state_dict. ``keep_state_layout`` restores the model's names (sharing the
same tensors) and persistence, so ``load_state_dict`` works both ways.

Example:
    >>> import torch
    >>> class M(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = torch.nn.Embedding(4, 2)
    ...         self.head = torch.nn.Linear(2, 4, bias=False)
    ...         self.head.weight = self.emb.weight  # tied
    ...         self.register_buffer("pos", torch.arange(2.0), persistent=False)
    ...     def forward(self, x):
    ...         return torch.nn.functional.linear(x + self.pos, self.emb.weight)
    >>> m = M()
    >>> gm = torch.fx.symbolic_trace(m)
    >>> sorted(gm.state_dict())  # head.weight lost, pos became persistent
    ['emb.weight', 'pos']
    >>> keep_state_layout(gm, m)
    >>> sorted(gm.state_dict()) == sorted(m.state_dict()) == ['emb.weight', 'head.weight']
    True
"""

from __future__ import annotations

from torch import nn

from qcompile.graph.meta import ROOT_NON_PERSISTENT_KEY


def _container(gm: nn.Module, path: str) -> nn.Module:
    mod = gm
    for part in path.split(".") if path else []:
        child = getattr(mod, part, None)
        if not isinstance(child, nn.Module):
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    return mod


def keep_state_layout(gm: nn.Module, root: nn.Module) -> None:
    """Give ``gm`` every parameter and buffer name ``root`` has, with root's persistence."""
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        target = None
        for name, p in mod._parameters.items():
            if p is None:
                continue
            target = target or _container(gm, mod_name)
            if getattr(target, name, None) is None:
                target.register_parameter(name, p)
        for name, b in mod._buffers.items():
            if b is None:
                continue
            target = target or _container(gm, mod_name)
            persistent = name not in mod._non_persistent_buffers_set
            if getattr(target, name, None) is None:
                target.register_buffer(name, b, persistent=persistent)
            elif name in target._buffers:
                if persistent:
                    target._non_persistent_buffers_set.discard(name)
                else:
                    target._non_persistent_buffers_set.add(name)


def keep_persistence(gm: nn.Module, root: nn.Module) -> None:
    """Mark ``gm``'s buffers non-persistent where ``root`` has them non-persistent."""
    for mod_name, mod in gm.named_modules():
        try:
            src = root.get_submodule(mod_name)
        except AttributeError:
            continue
        for name in list(mod._buffers):
            if name in src._non_persistent_buffers_set:
                mod._non_persistent_buffers_set.add(name)


def keep_root_persistence(gm: nn.Module) -> None:
    """Keep ``gm``'s root-level non-persistent buffers non-persistent in its deep copies.

    ``GraphModule.__deepcopy__`` rebuilds the root and registers every buffer the graph
    reads there as persistent: a copy's ``state_dict`` would then hold a key the original's
    has not (``load_state_dict`` of one into the other fails). The names go into
    ``gm.meta`` (which deep copies and ``torch.save`` keep) and a deep-copy hook marks them
    again. Call it once the root's buffers are all registered.

    Example:
        >>> import copy, torch
        >>> class M(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("shift", torch.ones(2), persistent=False)
        ...     def forward(self, x):
        ...         return x + self.shift
        >>> gm = torch.fx.symbolic_trace(M())
        >>> keep_state_layout(gm, M())
        >>> keep_root_persistence(gm)
        >>> list(copy.deepcopy(gm).state_dict())
        []
    """
    names = sorted(n for n in gm._non_persistent_buffers_set if n in gm._buffers)
    meta = getattr(gm, "meta", None)
    hooks = getattr(gm, "_deepcopy_hooks", None)
    if not names or not isinstance(meta, dict) or not isinstance(hooks, list):
        return
    meta[ROOT_NON_PERSISTENT_KEY] = names
    if _mark_root_non_persistent not in hooks:
        hooks.append(_mark_root_non_persistent)


def _mark_root_non_persistent(gm: nn.Module) -> None:
    for name in getattr(gm, "meta", {}).get(ROOT_NON_PERSISTENT_KEY, ()):
        if name in gm._buffers:
            gm._non_persistent_buffers_set.add(name)
