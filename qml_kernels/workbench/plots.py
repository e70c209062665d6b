"""Plots of benchmark results against the card's ceilings (matplotlib)."""

from __future__ import annotations

from collections import defaultdict

from qml_kernels.workbench.bench import H200_BF16_TFLOPS, H200_COPY_GBPS, BenchResult


def plot_bench(results: list[BenchResult], metric: str = "gbps", title: str | None = None, ax=None):
    """Grouped bars: one group per case, one bar per implementation, and the ceiling as a line.

    ``metric`` is "gbps" (memory-bound ops) or "tflops" (GEMM, attention).
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 1.3 * len({r.case for r in results}) + 2), 3.6))
    cases = list(dict.fromkeys(r.case for r in results))
    by_impl: dict[str, dict[str, float]] = defaultdict(dict)
    for r in results:
        by_impl[r.impl][r.case] = getattr(r, metric)
    width = 0.8 / max(1, len(by_impl))
    for i, (impl, values) in enumerate(by_impl.items()):
        xs = [c + i * width for c in range(len(cases))]
        ax.bar(xs, [values.get(c, 0.0) for c in cases], width, label=impl)
    on_gpu = any(r.device.startswith("cuda") for r in results)
    if on_gpu:
        ceiling = H200_COPY_GBPS if metric == "gbps" else H200_BF16_TFLOPS
        ax.axhline(ceiling, color="k", linestyle="--", linewidth=1, label="H200 measured ceiling")
        if metric == "gbps":
            ax.axhline(0.8 * ceiling, color="gray", linestyle=":", linewidth=1, label="80% target")
    ax.set_xticks([c + width * (len(by_impl) - 1) / 2 for c in range(len(cases))])
    ax.set_xticklabels(cases, rotation=20, ha="right")
    ax.set_ylabel("GB/s" if metric == "gbps" else "TFLOP/s")
    ops = sorted({r.op for r in results})
    device = results[0].device if results else ""
    ax.set_title(title or f"{', '.join(ops)} ({results[0].dtype if results else ''}, {device})")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax
