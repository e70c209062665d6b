"""What the engine benchmarks share: the results being recorded, and an engine driven in-process
(``engine_h200.py`` and its turn probes, ``engine_turns.py``)."""

from __future__ import annotations

import gc
import threading
import time

import torch

from qml_runtime.sampling_params import SamplingParams

RESULTS: dict = {}


def record(section: str, **values) -> None:
    RESULTS.setdefault(section, {}).update(values)
    print(f"[{section}] " + ", ".join(f"{k}={v}" for k, v in values.items() if not isinstance(v, (list, dict))),
          flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- engine ----------------------------------------------------------------------------------

def _served_engine(args, device, kv_host_gib: float = 0, **tiers):
    """The preset's engine as the engine sections measure it (random weights, no host tier unless
    ``kv_host_gib``, no disk tier unless ``tiers`` name one)."""
    from qml_runtime.loader import load_engine

    return load_engine(f"preset:{args.preset}", random_weights=True, device=str(device),
                       kv_cache_gib=args.kv_cache_gib, max_num_seqs=64, max_tokens_alone=32768,
                       kv_host_gib=kv_host_gib, progress=False, **tiers)


def _timed_request(engine, ids: list[int], params: SamplingParams, tokens: list[int] | None = None) -> list[float]:
    """Submit one request; returns the arrival time of each token (perf_counter), from submit = 0.
    ``tokens``: a list the request's token ids are appended to."""
    done, stamps = threading.Event(), []
    t0 = time.perf_counter()

    def emit(out):
        if isinstance(out, BaseException):
            stamps.append(out)
            done.set()
            return
        now = time.perf_counter() - t0
        stamps.extend([now] * len(out.token_ids))
        if tokens is not None:
            tokens.extend(out.token_ids)
        if out.finished:
            done.set()

    engine.submit(ids, params, emit)
    done.wait()
    if stamps and isinstance(stamps[-1], BaseException):
        raise stamps[-1]
    return stamps


def _concurrent_requests(engine, prompts: list[list[int]], params: SamplingParams,
                         tokens: list[list[int]] | None = None) -> list[list[float]]:
    """Submit every prompt at once (a thread each); each request's token stamps (``_timed_request``),
    and its token ids into ``tokens[i]`` when given."""
    results = [None] * len(prompts)

    def one(i):
        results[i] = _timed_request(engine, prompts[i], params, None if tokens is None else tokens[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


def _kernel_rows(prof, cuda: bool = True) -> list[tuple[str, int, float]]:
    """(kernel, calls, ms) of a profile, longest first: GPU time, or on CPU the ops' own time."""
    rows = []
    for e in prof.key_averages():
        if cuda and "CPU" in str(getattr(e, "device_type", "")):
            continue  # (with CPU activity on, an op's device time would count its kernels twice)
        t = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) if cuda \
            else e.self_cpu_time_total
        if t > 0:
            rows.append((e.key[:90], e.count, t / 1e3))
    return sorted(rows, key=lambda r: -r[2])


def _kernel_calls(prof, needle: str) -> dict | None:
    """The device durations (us) of the kernels whose name holds ``needle``, call by call in launch order:
    whether a kernel is slow in every layer or only in some (the first layers after an idle GPU, say)."""
    calls = sorted((e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
                   if "CUDA" in str(getattr(e, "device_type", "")) and needle in e.name)
    if not calls:
        return None
    us = [round(d, 1) for _, d in calls]
    return {"calls": len(us), "first": us[:4], "last": us[-4:], "min": min(us), "median": sorted(us)[len(us) // 2],
            "max": max(us)}


def _loop_counters(engine) -> dict:
    """The engine thread's cumulative time split (schedule / step / post, launch inside step) and steps."""
    return dict(engine.loop_seconds, launch=engine.runner.launch_seconds, steps=engine.loop_steps)
