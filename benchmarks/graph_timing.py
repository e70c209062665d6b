"""Timing launches the way the engine runs them: captured in one CUDA graph, replayed.

``graph_ms(fn)``: the median time of one replay of a graph of ``fn()`` (``decode_ablation.py``: a decode step).
``scrubbed_graph_ms(calls, scrub)``: a graph of one call per layer (``attention_splits_h200.py``,
``moe_fused_norms_h200.py``), each layer's call with its own inputs and a 64 MiB ``scrub.add_(1)`` after it,
which evicts what the layer's other kernels would (the H200's L2 is 50 MB); subtract the time of a graph of
the scrubs alone (``[lambda: None] * n``) to get the calls' own.
"""

from __future__ import annotations

import torch


def graph_ms(fn, reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph of ``fn()`` (run once on a side stream first: compiles)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def scrubbed_graph_ms(calls, scrub: torch.Tensor, reps: int = 20) -> float:
    """Median ms of one replay of a graph running ``calls`` in order, a scrub of L2 after each."""
    def run():
        for call in calls:
            call()
            scrub.add_(1)

    return graph_ms(run, reps)
