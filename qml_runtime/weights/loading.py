"""Copy checkpoint tensors into a model's parameters, by a table of name patterns.

A model declares, per file format, a table from a regex over checkpoint tensor
names to ``(parameter path, shard)``. The path may contain ``{}`` for the numbers
the regex captures (the layer, the expert). A path ending in ``[{}]`` names one
slice of a stacked parameter: ``experts_down[{}]`` with expert 5 captured writes
``experts_down[5]``, which is how checkpoints with one tensor per expert fill an
``[E, ...]`` parameter. ``shard`` names a row block of a fused parameter (q/k/v of
``wqkv``, gate/up of ``w_gate_up``), whose row ranges the model gives in
``model.shards``; rows are the second-to-last dimension, so a shard of a stacked
``[E, 2I, D]`` parameter is the same block in every expert. Every parameter must be
written exactly once, and every tensor in the file must be claimed: a silent
mismatch is worse than a load error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol

import torch
from tqdm.auto import tqdm


class WeightSource(Protocol):
    def names(self) -> list[str]: ...
    def load(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...


class WeightLoadError(ValueError):
    pass


def load_weights(
    model: torch.nn.Module,
    source: WeightSource,
    table: dict[str, tuple[str, str | None]],
    ignore: Iterable[str] = (),
    progress: bool = True,
) -> None:
    """Fill ``model``'s parameters from ``source`` following ``table`` (see module doc)."""
    patterns = [(re.compile(pat), target) for pat, target in table.items()]
    ignored = [re.compile(pat) for pat in ignore]
    params = dict(model.named_parameters())
    targets = {**dict(model.named_buffers()), **params}  # buffers are optional extras (rope tables)
    shards: dict[str, dict[str, slice]] = getattr(model, "shards", {})
    written: dict[str, int] = {}  # parameter path -> elements written
    names = source.names()
    for name in tqdm(names, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        if any(p.fullmatch(name) for p in ignored):
            continue
        for pattern, (path_fmt, shard) in patterns:
            match = pattern.fullmatch(name)
            if match:
                break
        else:
            raise WeightLoadError(f"unexpected tensor {name!r} in the checkpoint (no parameter takes it)")
        where = path_fmt.format(*match.groups())
        path, _, index = where.partition("[")
        if path not in targets:
            raise WeightLoadError(f"tensor {name!r} maps to {path!r}, which the model does not have")
        dest = targets[path].data
        if index:
            i = int(index.rstrip("]"))
            if not 0 <= i < dest.shape[0]:
                raise WeightLoadError(f"tensor {name!r} maps to {where}, past {path}'s {dest.shape[0]} slices")
            dest = dest[i]
        if shard is not None:
            rows = shards[path.rsplit(".", 1)[-1]][shard]
            dest = dest[..., rows, :] if dest.dim() >= 2 else dest[rows]
        tensor = source.load(name, dest.dtype, dest.device)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise WeightLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"{where}{'[' + shard + ']' if shard else ''} expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        written[path] = written.get(path, 0) + dest.numel()
    missing = [p for p, t in params.items() if written.get(p, 0) != t.numel()]
    if missing:
        raise WeightLoadError(f"the checkpoint does not provide: {', '.join(missing[:8])}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
