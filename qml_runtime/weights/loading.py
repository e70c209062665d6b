"""Copy checkpoint tensors into a model's parameters, by a table of name patterns.

A model declares, per file format, a table from a regex over checkpoint tensor
names to ``(parameter path, shard)``. The path may contain ``{}`` for the layer
number captured by the regex; ``shard`` names a row block of a fused parameter
(q/k/v of ``wqkv``, gate/up of ``w_gate_up``), whose row ranges the model gives in
``model.shards``. Every parameter must be written exactly once, and every tensor
in the file must be claimed: a silent mismatch is worse than a load error.
"""

from __future__ import annotations

import re
from typing import Iterable, Protocol

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
    written: dict[str, int] = {}  # parameter path -> rows written
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
        path = path_fmt.format(*match.groups())
        if path not in targets:
            raise WeightLoadError(f"tensor {name!r} maps to {path!r}, which the model does not have")
        dest = targets[path].data
        if shard is not None:
            rows = shards[path.rsplit(".", 1)[-1]][shard]
            dest = dest[rows]
        tensor = source.load(name, dest.dtype, dest.device)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise WeightLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"{path}{'[' + shard + ']' if shard else ''} expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        written[path] = written.get(path, 0) + (dest.shape[0] if dest.dim() else 1)
    missing = [p for p, t in params.items() if written.get(p, 0) != (t.shape[0] if t.dim() else 1)]
    if missing:
        raise WeightLoadError(f"the checkpoint does not provide: {', '.join(missing[:8])}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
