"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

A batch-1 decode step is ~600 launches in a row (Qwen3-30B-A3B, 48 layers), most of them a few
microseconds long. Inside a CUDA graph each still pays the gap between two kernels in a stream:
the previous grid drains (its last CTAs, then the memory flush), the next one is scheduled, its
CTAs start, compute addresses and issue their first loads, and only then do bytes flow again. On
the H200 the step's kernels summed to 3.29 ms of a 3.55 ms step (the 0.27 ms between them is only
the idle part; each kernel's own ramp-up is inside its time).

Hopper lets a kernel launched with the programmatic-stream-serialization attribute start before
its predecessor has finished:

- ``griddepcontrol.launch_dependents`` (``gdc_launch_dependents``): once every CTA of the running
  kernel has executed it (or exited), the next kernel's CTAs may be scheduled;
- ``griddepcontrol.wait`` (``gdc_wait``): blocks until the previous kernel has completed and its
  memory is visible. Everything that reads what an earlier kernel wrote, and every store (an
  earlier kernel may still read the buffer), must come after it.

Every kernel here calls ``enter`` first, which keeps two rules:
1. ``gdc_wait`` before any load and any store, in every program (a program that returns early
   returns after it);
2. ``gdc_launch_dependents`` right after the wait, not before: the next kernel's CTAs are
   scheduled while this one runs (their launch and start-up overlap its work), but never two
   kernels ahead.
Because every PDL kernel waits for its predecessor before it can complete, completion stays
transitive along the stream: a kernel that waited has all kernels before it complete. Kernels
launched without the attribute (cuBLAS, torch's own, copies) keep the ordinary full dependency,
and a PDL kernel after one of them starts when it ends. ``tests/test_pdl.py`` checks rule 1 in
the sm_90a PTX of every kernel that takes the ``PDL`` constexpr.

Measured on the H200 (``benchmarks/pdl_h200.py``, 2026-12-03, in-process decode from the CUDA
graphs, 128 greedy steps, medians of three): Qwen3-30B-A3B batch 1 3.329-3.342 -> 3.165-3.190
ms a step (-5%), the same tokens; batch 32 and Llama-3.1-8B (whose decode GEMMs are cuBLAS'
nvjet kernels, launched without the attribute) within noise. Tried and not kept: the decode
GEMV asking L2 for its weight rows before its wait (``prefetch.global.L2``: 3.180 without it,
3.190 with), and the MoE down projection prefetching its chosen experts' weights while the
gate-up GEMM still ran (its grouping is two kernels back, complete once it starts): 3.360 with
normal priority, 3.442 with ``evict_last``; the prefetch competed with the gate-up GEMM's own
stream instead of filling a gap. Nor an L2 prefetch of the next weight stream issued two kernels
ahead, across the small kernels between two streams (``cp.async.bulk.prefetch.L2`` from a grid of
one-warp programs; ``benchmarks/l2_prefetch_h200.py``, 2026-12-04): the GEMV after it was no faster
even with an 8 us gap, and the decode step went 3.078 -> 3.367 ms.

``QML_PDL=0`` launches everything without the attribute (the ``PDL`` constexpr off, so the
kernels carry no grid-dependency instructions at all); off on CPU, under the interpreter, and on
GPUs before sm_90.

Sources: the CUDA programming guide, "Programmatic Dependent Launch and Synchronization"; the PTX
ISA, ``griddepcontrol`` and ``prefetch``; Triton's ``tl.extra.cuda.gdc_*`` and ``launch_pdl``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's grid-dependency control (tl.extra.cuda.gdc_*, with the launch_pdl option beside it) is in 3.6 and
# 3.9, the versions used here; a Triton without it launches everything without PDL
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    _TRITON_HAS_PDL = True
except ImportError:
    _TRITON_HAS_PDL = False
ENABLED = _TRITON_HAS_PDL and os.environ.get("QML_PDL", "1") != "0"
_ON, _OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}  # shared: launches only unpack them
_by_device: dict[torch.device, bool] = {}  # asked at every launch (~900 in a Qwen3-MoE prefill): cached


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def enabled(t: torch.Tensor) -> bool:
    """Whether launches for tensors on ``t``'s device use PDL."""
    on = _by_device.get(t.device)
    if on is None:
        on = t.is_cuda and not _interpreting() and torch.cuda.get_device_capability(t.device)[0] >= 9
        _by_device[t.device] = on
    return ENABLED and on


def launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel that takes a ``PDL`` constexpr: the constexpr,
    and Triton's launch option that sets the attribute when it is on."""
    return _ON if enabled(t) else _OFF


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the kernels before this one, then let the next one start (the module's rules)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

