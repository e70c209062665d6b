"""The engine benchmark's turn probes (``engine_h200.py --sections hostturn,gputurn,afterfresh``): the next
turn of a 27k-token conversation, its history in host RAM or in GPU memory, timed in-process; with
``--timeline`` the device's work per stream and bin, with ``--sample-stacks`` the engine thread's stack."""

from __future__ import annotations

import json
import statistics
import time

import torch
from engine_common import _kernel_calls, _kernel_rows, _loop_counters, _served_engine, _timed_request, record

from qml_runtime.sampling_params import SamplingParams


def _tiered_engine(args, device, host_factor: int, prefix: str):
    """The sessions bench's GPU pool (``--kv-cache-gib``) with ``host_factor`` times that of host RAM (the
    turns must not fill it), and a disk tier in a temporary directory with ``--kv-disk-gib``: (engine, dir)."""
    import tempfile

    disk = tempfile.mkdtemp(prefix=prefix) if args.kv_disk_gib else None
    return _served_engine(args, device, kv_host_gib=host_factor * args.kv_cache_gib, kv_disk_dir=disk,
                          kv_disk_gib=args.kv_disk_gib or None), disk


def _conversation(engine, seed: int):
    """Start ``engine`` and prefill a history of ~27k random ids (one token generated). Returns
    (``ids(n)``: n more random ids, the history, one-token greedy params)."""
    engine.start()
    vocab, gen = engine.model_config.vocab_size, torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(300, vocab, (n,), generator=gen).tolist()

    one = SamplingParams(max_tokens=1, temperature=0.0)
    hist = ids(min(27120, engine.context_length // 2))
    _timed_request(engine, hist, one)
    return ids, hist, one


def _backlog(engine) -> dict:
    """What is still on its way down: kept pages not yet pumped, disk writes queued."""
    return {"deferred_pages": engine.tiers.deferred,
            "pending_write_gib": round(engine.tiers.pending_write_bytes / 2**30, 2)}


def _timers(args, engine):
    """``--call-timers``: the engine thread's time in the tiers' and loop's methods, per turn."""
    if not getattr(args, "call_timers", False):
        return None
    from loop_profile import CallTimers  # beside this script

    return CallTimers(engine, engine._thread.ident)


def section_hostturn(args, device) -> None:
    """A 219-token turn over a 27k-token history pushed into host RAM (the sessions bench's host
    case, in-process): the engine loop's split (schedule / step / post) and a profile of the turn."""
    from loop_profile import TurnProfile, device_timeline  # beside this script
    from torch.profiler import ProfilerActivity, profile

    engine, disk = _tiered_engine(args, device, 5, "qml-hostturn-")
    ids, hist, one = _conversation(engine, seed=6)
    n_hist = len(hist)
    turn_prof = TurnProfile() if args.profile_turn else None
    timers = _timers(args, engine)
    pool_tokens = engine.blocks.num_blocks * engine.blocks.block_size
    turns = []
    for i in range(args.turns):
        other = min(20000, n_hist)
        n_other = -(-pool_tokens // other) + 1
        timeline = None
        for j in range(n_other):  # other prompts push the history into host RAM
            if args.timeline and i == 0 and j == n_other - 1 and device.type == "cuda":
                # the device from the burst's last prompt on: what its aftermath leaves beside the turn
                timeline = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                timeline.__enter__()
            _timed_request(engine, ids(other), one)
        hist = hist + ids(219)
        was, restored = _loop_counters(engine), engine.tiers.stats.restored_host
        backlog = _backlog(engine)  # when the turn arrives
        t_submit = None  # (set for the turns timed without a profiler or sampler)
        if timers is not None:
            timers.mark()
        if (args.sample_stacks or timeline is not None) and i == 0:
            # the first turn after the burst: where the engine thread was (stacks) and what the device did
            # (timeline); both at once when both are asked for (the sampler's thread then shares the GIL)
            sampler = None
            if args.sample_stacks:
                from loop_profile import StackSampler

                sampler = StackSampler(engine._thread.ident)
                sampler.start()
            if timeline is not None:
                with torch.profiler.record_function("turn-submit"):
                    pass
            t = _timed_request(engine, hist, one)[0] * 1e3
            if sampler is not None:
                sampler.stop()
                text = sampler.summary()
                (args.out / "hostturn-turn1-stacks.txt").write_text(text)
                print(text[:9000], flush=True)
            if timeline is not None:
                timeline.__exit__(None, None, None)
                text = device_timeline(timeline, args.out / "hostturn-turn1-trace.json", marker="turn-submit")
                (args.out / "hostturn-turn1-timeline.txt").write_text(text)
                print(text[:8000], flush=True)
        elif i == 0 and turn_prof is not None:  # the first turn after the burst: where its host time goes
            with turn_prof.turn():
                t = _timed_request(engine, hist, one)[0] * 1e3
            text = turn_prof.dump(args.out / f"hostturn-turn1-cprofile{'-disk' if disk else ''}.txt", 45)
            print(text[:6000], flush=True)
        elif i == 2 and turn_prof is not None and device.type == "cuda":
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = _timed_request(engine, hist, one)[0] * 1e3
            (args.out / "hostturn-profile.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
            cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            (args.out / "hostturn-profile-cpu.txt").write_text(cpu)
            print(cpu, flush=True)
        else:
            t_submit = time.perf_counter()
            t = _timed_request(engine, hist, one)[0] * 1e3
        now = _loop_counters(engine)
        split = {k: round((now[k] - was[k]) * 1e3, 2) for k in ("schedule", "step", "post", "launch")}
        st = engine.tiers.stats
        calls = timers.delta() if timers is not None else None
        spans = timers.span_list() if timers is not None else None
        # from the submit to the restore's first copy (unprofiled turns): what the turn waits for before its copy
        launched = engine.tiers.restore_launched
        to_copy = round((launched - t_submit) * 1e3, 2) if t_submit is not None and launched > t_submit else None
        turns.append({"ttft_ms": round(t, 2), "to_copy_ms": to_copy, "restored_pages": st.restored_host - restored,
                      "calls": calls,
                      "spans": spans,
                      "spilled_host": st.spilled_host, "kept_host": st.kept_host,
                      "steps": now["steps"] - was["steps"], "loop_ms": split, "backlog": backlog,
                      "written_disk": st.written_disk, "persist_skipped": st.persist_skipped,
                      "rates": engine.tiers.planner.rates(), "plans": dict(st.plans),
                      "beside_scale": round(engine.tiers.planner.beside_scale, 3)})
        print("host turn:", turns[-1], flush=True)
    record("hostturn", turns=turns)
    engine.shutdown()


def section_gputurn(args, device) -> None:
    """A short turn over a 27k-token history still in GPU memory (the sessions bench's GPU case,
    in-process), of 219 and of 150 new tokens (that bench's turn before and after kept replies,
    qml_server.replies): TTFT of three turns, then the fourth's kernels."""
    from torch.profiler import ProfilerActivity, profile

    engine = _served_engine(args, device)
    ids, hist, one = _conversation(engine, seed=7)
    from loop_profile import TurnProfile  # beside this script

    turn_prof = TurnProfile() if args.profile_turn else None
    results = {}
    for new in (int(x) for x in args.gputurn_sizes.split(",") if x):
        times, splits = [], []
        for _ in range(3):
            hist = hist + ids(new)
            was = _loop_counters(engine)
            times.append(round(_timed_request(engine, hist, one)[0] * 1e3, 2))
            now = _loop_counters(engine)  # the TTFT outside these is submit, wake-up and emit
            splits.append({k: round((now[k] - was[k]) * 1e3, 2) for k in ("schedule", "step", "post", "launch")})
        if turn_prof is not None:
            hist = hist + ids(new)
            with turn_prof.turn():
                _timed_request(engine, hist, one)
            turn_prof.dump(args.out / f"gputurn-{new}-cprofile.txt", 45)
            turn_prof.prof.clear()
        hist = hist + ids(new)
        cuda = device.type == "cuda"
        acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=acts + ([ProfilerActivity.CPU] if cuda and args.timeline else [])) as prof:
            with torch.profiler.record_function("turn-submit"):
                pass
            wall = _timed_request(engine, hist, one)[0] * 1e3
        if args.timeline and cuda:
            from loop_profile import device_timeline

            text = device_timeline(prof, args.out / f"gputurn-{new}-trace.json", bin_ms=1.0, marker="turn-submit")
            (args.out / f"gputurn-{new}-timeline.txt").write_text(text)
            print(text[:6000], flush=True)
        rows = _kernel_rows(prof, cuda)
        results[str(new)] = {"ttft_ms": times, "loop_ms": splits, "profiled_ttft_ms": round(wall, 2),
                             "gpu_ms": round(sum(r[2] for r in rows), 2),
                             # cuDNN's turn attention, layer by layer (~223 us a layer here, ~150 in a bench)
                             "sdpa_us": _kernel_calls(prof, "sdpa") if cuda else None,
                             "top": [{"kernel": k[:90], "calls": c, "ms": round(ms, 3)} for k, c, ms in rows[:12]]}
        print(f"gpu turn {new}:", json.dumps(results[str(new)]), flush=True)
    probes = {"clock": _clock_probe, "launch": _launch_probe}
    for name in (p for p in args.probes.split(",") if p) if device.type == "cuda" else ():
        try:
            results[f"{name}_probe"] = probes[name](engine, ids, hist, one)
        except Exception as e:  # noqa: BLE001 - a probe's failure must not lose the section's numbers
            results[f"{name}_probe"] = {"error": repr(e)}
        print(f"{name} probe:", json.dumps(results[f"{name}_probe"]), flush=True)
    record("gputurn", **results)
    engine.shutdown()


def _clock_probe(engine, ids, hist: list[int], one) -> dict:
    """The profiled 150-token turn again, after the GPU sat idle for 2 s and right after ~0.2 s of GEMMs
    (synchronized before the submit): whether the cuDNN kernel's ~223 us a layer in the engine, against
    ~150 in a bench that keeps the GPU busy, follows the GPU's state (clocks) rather than the turn. The wall
    times (``time.time()``) line up with the driver's ``nvidia-smi`` samples."""
    from torch.profiler import ProfilerActivity, profile

    a, b = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    out = {}
    for name in ("after-idle", "after-gemms", "after-idle-2", "after-gemms-2"):
        torch.cuda.synchronize()
        if name.startswith("after-idle"):
            time.sleep(2.0)
        else:
            for _ in range(1200):  # ~0.2 s of GEMMs (random operands: a full power draw), on the engine's stream
                torch.mm(a, b, out=c)
            torch.cuda.synchronize()
        hist = hist + ids(150)
        t0 = time.time()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = _timed_request(engine, hist, one)[0] * 1e3
        rows = _kernel_rows(prof, True)
        out[name] = {"wall_s": round(t0, 3), "ttft_ms": round(wall, 2), "gpu_ms": round(sum(r[2] for r in rows), 2),
                     "sdpa_us": _kernel_calls(prof, "sdpa"), "gemm_us": _kernel_calls(prof, "nvjet"),
                     "top": [{"kernel": k[:60], "calls": n, "ms": round(ms, 3)} for k, n, ms in rows[:4]]}
    return out


def _launch_probe(engine, ids, hist: list[int], one, turns: int = 3) -> dict:
    """Where the 150-token GPU-history turn's host time goes, unprofiled: host stamps (perf_counter) at the
    prefill graph's ``run`` (after the engine's wake-up and schedule), around its ``replay`` call and when the
    token reaches the host, and CUDA events around the replay (the graph's device time, the GPU idle before).
    Turns after 2 s idle (uncapped clocks) and back to back; ms from the submit. In the ``preload`` turns a
    3 ms sleep kernel runs before the first event, so the graph is all queued when the GPU reaches it: its
    device time then has no launch latency in it (the difference is what the replay call leaves exposed)."""
    from qml_runtime import runner
    from qml_runtime.cuda_graphs import PrefillGraphs

    stamps: dict = {}
    run, replay, host_values = PrefillGraphs.run, PrefillGraphs._replay, runner.ModelRunner._host_values

    def run_probe(self, seq, n):
        stamps.setdefault("run", time.perf_counter())
        return run(self, seq, n)

    def replay_probe(self, key):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stamps["replay"] = time.perf_counter()
        if stamps.get("preload"):
            torch.cuda._sleep(6_000_000)  # ~3 ms at the H100/H200's clocks
        e0.record()
        out = replay(self, key)
        e1.record()
        stamps["replayed"], stamps["events"] = time.perf_counter(), (e0, e1)
        return out

    def host_values_probe(tokens, while_running):
        out = host_values(tokens, while_running)
        stamps["token"] = time.perf_counter()
        return out

    PrefillGraphs.run, PrefillGraphs._replay = run_probe, replay_probe
    runner.ModelRunner._host_values = staticmethod(host_values_probe)
    rows = []
    try:
        modes = [m for m in ("idle", "idle-preload", "turns", "turns-preload") for _ in range(turns)]
        for mode in modes:
            torch.cuda.synchronize()
            if mode.startswith("idle"):
                time.sleep(2.0)
            hist = hist + ids(150)
            stamps.clear()
            stamps["preload"] = mode.endswith("preload")
            t0 = time.perf_counter()
            ttft = _timed_request(engine, hist, one)[0] * 1e3
            e0, e1 = stamps["events"]
            e1.synchronize()

            def ms(a, b):
                return round((stamps[b] - (t0 if a == "submit" else stamps[a])) * 1e3, 3)
            graph = e0.elapsed_time(e1)
            rows.append({"mode": mode, "ttft": round(ttft, 3),
                         "submit_to_run": ms("submit", "run"), "run_to_replay": ms("run", "replay"),
                         "replay_call": ms("replay", "replayed"), "graph_device": round(graph, 3),
                         "replay_to_token": ms("replay", "token"),
                         # what the host adds after the replay's start beyond the graph's device time
                         "wait_excess": round(ms("replay", "token") - graph, 3),
                         "token_to_emit": round(ttft - ms("submit", "token"), 3)})
    finally:
        PrefillGraphs.run, PrefillGraphs._replay = run, replay
        runner.ModelRunner._host_values = staticmethod(host_values)
    medians = {mode: {k: round(statistics.median(r[k] for r in rows if r["mode"] == mode), 3)
                      for k in rows[0] if k != "mode"} for mode in dict.fromkeys(modes)}
    return {"medians": medians, "turns": rows}


def section_afterfresh(args, device) -> None:
    """The sessions bench's second GPU-history turn, in-process: a 150-token turn over a 27k-token
    history still in GPU memory, sent right after an unrelated 27k-token prompt has finished (whose
    pages then go down to host RAM, and to disk with ``--kv-disk-gib``). TTFT of three such turns,
    with what was still on its way down when each arrived; ``--timeline``: the device and the host's
    launches from the fresh prompt through the first turn."""
    from loop_profile import device_timeline  # beside this script
    from torch.profiler import ProfilerActivity, profile

    engine, disk = _tiered_engine(args, device, 4, "qml-afterfresh-")
    ids, hist, one = _conversation(engine, seed=8)
    timers = _timers(args, engine)
    n_hist = len(hist)
    turns = []
    for i in range(3):
        timeline = None
        if args.timeline and i == 0 and device.type == "cuda":
            timeline = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            timeline.__enter__()
        fresh = _timed_request(engine, ids(n_hist), one)[0] * 1e3
        hist = hist + ids(150)
        if timers is not None:  # from the fresh prompt's token on: what the loop did before the turn
            timers.mark()
        backlog = _backlog(engine)
        was = _loop_counters(engine)
        if timeline is not None:
            with torch.profiler.record_function("turn-submit"):
                pass
        t = _timed_request(engine, hist, one)[0] * 1e3
        now = _loop_counters(engine)
        if timeline is not None:
            timeline.__exit__(None, None, None)
            text = device_timeline(timeline, args.out / "afterfresh-trace.json", bin_ms=2.0, marker="turn-submit")
            (args.out / f"afterfresh-timeline{'-disk' if disk else ''}.txt").write_text(text)
            print(text[:7000], flush=True)
        calls = timers.delta() if timers is not None else None
        spans = timers.span_list() if timers is not None else None
        turns.append({"ttft_ms": round(t, 2), "fresh_ms": round(fresh, 1), "backlog": backlog, "calls": calls,
                      "spans": spans,
                      "loop_ms": {k: round((now[k] - was[k]) * 1e3, 2) for k in ("schedule", "step", "post")}})
        print("after fresh:", turns[-1], flush=True)
    record("afterfresh", disk=bool(disk), turns=turns)
    engine.shutdown()
