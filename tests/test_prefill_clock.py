"""The prefill steps' times that the restore planner learns from: on a GPU from timing events once the device has
passed them (a step that samples nothing returns to the host long before its work is done), on a CPU from the
host."""

from __future__ import annotations

import time

import pytest
import torch

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.engine import Engine
from qml_runtime.kv import prefill_clock
from qml_runtime.kv.prefill_clock import PrefillClock
from qml_runtime.sampling_params import SamplingParams


class Events:
    """A CUDA timing event's surface over a fake device: events are recorded in order and the device passes
    them when told (``run``); elapsed time is the gap between their device stamps, in ms."""

    def __init__(self):
        self.recorded: list[Events.Event] = []
        self.now_ms = 0.0

    class Event:
        def __init__(self, device):
            self.device, self.stamp = device, None

        def record(self):
            self.device.recorded.append(self)

        def query(self) -> bool:
            return self.stamp is not None

        def elapsed_time(self, end) -> float:
            assert self.stamp is not None and end.stamp is not None
            return end.stamp - self.stamp

    def __call__(self):
        return Events.Event(self)

    def run(self, ms_each: float, count: int | None = None) -> None:
        """The device passes the next ``count`` (all) waiting events, ``ms_each`` apart."""
        for event in [e for e in self.recorded if e.stamp is None][:count]:
            self.now_ms += ms_each
            event.stamp = self.now_ms


def test_on_the_host_a_step_is_observed_at_once_with_its_host_time():
    seen = []
    clock = PrefillClock(lambda chunks, seconds, beside: seen.append((chunks, seconds, beside)))
    mark = clock.start()
    assert mark is None
    clock.stop(mark, [(0, 512)], 0.25, beside=True)
    assert seen == [([(0, 512)], 0.25, True)] and clock.poll() == 0


def test_on_the_device_a_step_waits_for_its_events_and_counts_their_time_not_the_hosts():
    seen, device = [], Events()
    clock = PrefillClock(lambda chunks, seconds, beside: seen.append((chunks, seconds, beside)), device)
    head = clock.start()
    clock.stop(head, [(0, 20_272)], 0.117)  # a split's head: back on the host after its launches
    second = clock.start()
    clock.stop(second, [(0, 4096)], 0.5, beside=True)
    assert seen == [] and clock.poll() == 2  # the device has not got there yet
    device.run(325.0, count=2)  # the head's start and end: 325 ms of device work
    assert clock.poll() == 1 and seen == [([(0, 20_272)], pytest.approx(0.325), False)]
    device.run(50.0)  # the next step's two events, 50 ms apart
    assert clock.poll() == 0 and seen[1] == ([(0, 4096)], pytest.approx(0.05), True)


def test_steps_nobody_polls_for_are_dropped_oldest_first(monkeypatch):
    monkeypatch.setattr(prefill_clock, "MAX_PENDING", 3)
    seen, device = [], Events()
    clock = PrefillClock(lambda chunks, seconds, beside: seen.append(chunks[0][1]), device)
    for n in range(5):
        clock.stop(clock.start(), [(0, 100 + n)], 0.0)
    device.run(1.0)
    assert clock.poll() == 0 and seen == [102, 103, 104]


def test_the_engine_teaches_the_planner_device_times_of_steps_that_sample_nothing(engine):
    """A prompt of 300 tokens in chunks of 128: the first two chunks sample nothing (on a GPU their host time
    would be their launches' alone). They reach the planner with their events' time once the device has passed
    them, at the next step, on the planner the tiers hold then."""
    cache = CacheConfig(block_size=16, num_blocks=64, host_bytes=16 * 2**20)
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="clock", device=engine.device,
                 dtype=engine.dtype, cache=cache, scheduler=SchedulerConfig(max_batched_tokens=128),
                 fingerprint=engine.scheduler.fingerprint)
    device, seen = Events(), []
    eng.prefill_clock._events = device  # the engine's clock, on a fake device

    class Planner:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def observe_prefill(self, chunks, seconds, beside=False):
            seen.append((chunks, seconds))

    eng.tiers.planner = Planner(eng.tiers.planner)
    eng.start()
    try:
        ids = [(7 * i) % 5000 + 100 for i in range(300)]
        eng.generate_sync(ids, SamplingParams(max_tokens=1, temperature=0.0))
        assert seen == []  # the device has passed none of the steps' events
        device.run(40.0)
        eng.generate_sync(ids[:70] + [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0))  # polls first
    finally:
        eng.shutdown()
    # (the last chunk, 44 tokens, and the second prompt's 9 are too short to teach the planner anything)
    assert seen == [([(0, 128)], pytest.approx(0.04)), ([(128, 128)], pytest.approx(0.04))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_step_is_timed_by_its_events_once_the_device_has_passed_them():
    """torch's CUDA events behind the clock: a step whose work (~100 ms of device sleep) is still running when
    the host is back waits, and then counts the device's time, not the launch's."""
    seen = []
    clock = PrefillClock(lambda chunks, seconds, beside: seen.append(seconds),
                         lambda: torch.cuda.Event(enable_timing=True))
    t0 = time.perf_counter()
    mark = clock.start()
    torch.cuda._sleep(200_000_000)  # cycles: ~100 ms at 2 GHz
    host = time.perf_counter() - t0
    clock.stop(mark, [(0, 4096)], host)
    assert seen == [] and clock.poll() == 1
    torch.cuda.synchronize()
    assert clock.poll() == 0 and len(seen) == 1 and seen[0] > max(10 * host, 0.01)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_engines_chunks_that_start_a_history_reach_the_planner():
    """A narrow model with Llama-3.1-8B's heads on the GPU, with a host tier: a 3,000-token prompt in chunks of
    1,024. The first two start the history (the first samples nothing); both reach the planner, timed on the
    device, by the next request's step; the third (over 2,048 cached tokens) teaches nothing."""
    import dataclasses

    from qml_runtime.presets import PRESETS, ByteTokenizer, Preset, random_model

    cfg = dataclasses.replace(PRESETS["llama-3.1-8b"].config, hidden_size=512, intermediate_size=1024, num_layers=2,
                              vocab_size=512, context_length=8192)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    net = random_model(Preset(cfg, "LlamaForCausalLM", "Llama-3.1-8B heads, narrow"), dev, torch.bfloat16)
    eng = Engine(net, ByteTokenizer(512), cfg, model_id="narrow", device=dev, dtype=torch.bfloat16,
                 cache=CacheConfig(block_size=16, num_blocks=512, host_bytes=64 * 2**20),
                 scheduler=SchedulerConfig(max_batched_tokens=1024, max_num_seqs=2), context_length=8192,
                 fingerprint=b"prefill-clock-gpu-test", cuda_graphs=False, warmup=False)
    seen = []
    real = eng.tiers.planner.observe_prefill
    eng.tiers.planner.observe_prefill = lambda chunks, seconds, beside=False: (
        seen.append((list(chunks), seconds)), real(chunks, seconds, beside=beside))
    eng.start()
    try:
        greedy = SamplingParams(max_tokens=2, temperature=0)
        eng.generate_sync([(5 * i) % 500 + 3 for i in range(3000)], greedy)
        eng.generate_sync([7, 8, 9], greedy)  # its steps poll the clock first
        assert eng.prefill_clock.poll() == 0
    finally:
        eng.shutdown()
    assert [c for c, _ in seen] == [[(0, 1024)], [(1024, 1024)]] and all(s > 0 for _, s in seen)
