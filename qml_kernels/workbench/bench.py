"""bench(): time an implementation on real shapes and place it against the card's ceilings.

On CUDA: ``triton.testing.do_bench`` (CUDA events, warm-up, median). Inputs are
rotated among enough copies to exceed the L2 cache (50 MB on the H200), so a
memory-bound kernel is not flattered by re-reading cached data. Bytes and FLOPs
come from the op's formulas (OpSpec.bytes_moved / flops); throughput is reported
as GB/s and TFLOP/s and as a fraction of the measured ceilings below.
On CPU the same loop is timed with perf_counter (for the notebooks' shape of
things; ceilings are not meaningful there).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from qml_kernels import registry
from qml_kernels.workbench.spec import Case, spec_for

# Measured on the H200 (device/README.md, 2026-11-30): device-to-device copy counts
# bytes read + written; the matmul is 8192^3 bf16 through cuBLAS.
H200_COPY_GBPS = 4220.0
H200_BF16_TFLOPS = 765.0
L2_BYTES = 50 * 2**20


@dataclass
class BenchResult:
    op: str
    impl: str
    case: str
    dtype: str
    device: str
    ms: float
    bytes: int
    flops: int

    @property
    def gbps(self) -> float:
        return self.bytes / (self.ms * 1e-3) / 1e9

    @property
    def tflops(self) -> float:
        return self.flops / (self.ms * 1e-3) / 1e12

    @property
    def frac_bandwidth(self) -> float:
        return self.gbps / H200_COPY_GBPS

    @property
    def frac_compute(self) -> float:
        return self.tflops / H200_BF16_TFLOPS

    def row(self) -> dict[str, Any]:
        return {"op": self.op, "impl": self.impl, "case": self.case, "dtype": self.dtype, "device": self.device,
                "ms": round(self.ms, 5), "GB/s": round(self.gbps, 1), "TFLOP/s": round(self.tflops, 2),
                "% of copy BW": round(100 * self.frac_bandwidth, 1),
                "% of bf16 peak": round(100 * self.frac_compute, 1)}


def _nbytes(inputs: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in inputs.values() if isinstance(v, torch.Tensor))


def _time_cpu(fn, warmup: int = 2, reps: int = 7) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench(op: str, impl: str = "triton", cases: list[Case] | None = None, dtype: torch.dtype = torch.bfloat16,
          device=None, config: Any = None, rep_ms: int = 100) -> list[BenchResult]:
    """Median time of ``impl`` on each case (default: the op's model-size cases on GPU, small ones on CPU)."""
    spec = spec_for(op)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fn = registry.get_impl(op, impl).fn
    extra = {} if config is None else {"config": config}
    if cases is None:
        cases = list(spec.model_cases) if dev.type == "cuda" and spec.model_cases else list(spec.cases)
    results = []
    for case in cases:
        gen = torch.Generator(dev).manual_seed(0)
        first = spec.make_inputs(case, dtype, dev, gen)
        copies = 1 if dev.type == "cpu" else max(1, min(8, -(-2 * L2_BYTES // max(1, _nbytes(first)))))
        sets = [first] + [spec.make_inputs(case, dtype, dev, gen) for _ in range(copies - 1)]
        turn = iter(range(1 << 62))

        def call():
            return fn(**sets[next(turn) % len(sets)], **extra)

        if dev.type == "cuda":
            import triton.testing

            ms = triton.testing.do_bench(call, warmup=25, rep=rep_ms, return_mode="median")
        else:
            ms = _time_cpu(call)
        results.append(BenchResult(op, impl, case.name, str(dtype).removeprefix("torch."), str(dev), ms,
                                   int(spec.bytes_moved(first)), int(spec.flops(first))))
    return results


def table(results: list[BenchResult]) -> str:
    """A plain-text table of bench results (for logs and notebook cells)."""
    rows = [r.row() for r in results]
    if not rows:
        return "(no results)"
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)
