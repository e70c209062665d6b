"""``QML_HANDOFF=1`` (``engine_requests.HANDOFF_S``): a request submitted to an idle engine has its submitter wait
until the request's first step is launched, and the engine lets it go on in every outcome: the step launched,
the request failed before any step; and a lone request's first decode step is not followed ahead. Checked on CPU
with the hand-over forced on (it is a GPU engine's: on CPU a step's ``while_running`` comes after its compute) and
the wait made long, so that a submitter left waiting shows as an unset event, not as a slow test."""

from __future__ import annotations

import pytest

from qml_runtime import engine_requests
from qml_runtime.presets import load_preset_engine
from qml_runtime.sampling_params import SamplingParams


@pytest.fixture()
def engine(monkeypatch):
    eng = load_preset_engine("preset:tiny-llama", True, device="cpu", kv_cache_gib=0.002)
    monkeypatch.setattr(engine_requests, "HANDOFF_S", 30.0)
    eng.hand_over = True
    eng.start()
    yield eng
    eng.shutdown()


def _submit(eng, prompt: list[int], max_tokens: int = 2):
    """Submit ``prompt``; -> (its sequence, its outputs' queue)."""
    import queue

    made = []
    real = eng._new_sequence
    eng._new_sequence = lambda *a, **k: made.append(real(*a, **k)) or made[-1]
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    try:
        eng.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), outputs.put)
    finally:
        eng._new_sequence = real
    return made[0], outputs


def _last(outputs):
    while True:
        out = outputs.get(timeout=60)
        if isinstance(out, BaseException) or out.finished:
            return out


def test_the_submitter_goes_on_once_the_first_step_is_launched(engine):
    seq, outputs = _submit(engine, list(range(30, 70)))
    assert seq.started is not None and seq.started.is_set()  # submit returned: the step had been launched
    assert _last(outputs).completion_tokens == 2
    busy_seq, busy_outputs = _submit(engine, list(range(30, 40)), max_tokens=200)
    other, other_outputs = _submit(engine, list(range(40, 50)))  # the engine is not idle: no hand-over
    assert busy_seq.started is not None and other.started is None
    _last(busy_outputs), _last(other_outputs)


def test_a_request_whose_step_fails_before_its_launch_lets_its_submitter_go(engine):
    real = engine.runner.step

    def failing(batch, eager=False, while_running=None):
        raise RuntimeError("the step failed before its kernels were queued")

    engine.runner.step = failing
    try:
        seq, outputs = _submit(engine, list(range(30, 50)), max_tokens=1)
        assert seq.started.is_set()
        assert isinstance(_last(outputs), RuntimeError)
    finally:
        engine.runner.step = real


def test_no_hand_over_without_the_flag_or_from_the_engine_thread(monkeypatch):
    monkeypatch.delenv("QML_HANDOFF", raising=False)
    eng = load_preset_engine("preset:tiny-llama", True, device="cpu", kv_cache_gib=0.002)
    assert not eng.hand_over  # (and on CPU never by itself: device.type != "cuda")
    eng.start()
    try:
        seq, outputs = _submit(eng, list(range(30, 50)))
        assert seq.started is None
        _last(outputs)
    finally:
        eng.shutdown()


def test_a_lone_requests_first_decode_step_is_not_followed_ahead():
    """With the hand-over, the decode step after a lone request's first token waits for the device before the next
    is launched behind it (the engine thread lets the server send the token): one launch fewer behind another,
    the same tokens. On CPU the decode graphs run their static-buffer path eagerly (as tests/test_overlap.py)."""
    from qml_runtime.config import CacheConfig, SchedulerConfig
    from qml_runtime.cuda_graphs import DecodeGraphs
    from qml_runtime.engine import Engine

    base = load_preset_engine("preset:tiny-llama", True, device="cpu", kv_cache_gib=0.002)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seen = {}
    for hand_over in (False, True):
        eng = Engine(base.model, base.tokenizer, base.model_config, model_id="t", device=base.device,
                     dtype=base.dtype, cache=CacheConfig(block_size=4, num_blocks=64), scheduler=SchedulerConfig(),
                     overlap=True)
        eng.runner.graphs = DecodeGraphs(base.model, eng.kv, base.device, 8, eng.context_length, capture=False)
        eng.hand_over = hand_over
        behind = []
        run = eng.runner.graphs.run
        eng.runner.graphs.run = lambda seqs, prev=None, run=run, behind=behind: (
            behind.append(prev is not None), run(seqs, prev))[-1]
        eng.start()
        try:
            out = eng.generate_sync(list(range(30, 50)), params)
        finally:
            eng.shutdown()
        seen[hand_over] = (out.token_ids, behind)
    assert seen[True][0] == seen[False][0] and len(seen[True][0]) == 8
    assert sum(seen[True][1]) == sum(seen[False][1]) - 1 > 0
    assert seen[True][1][:2] == [False, False] and seen[False][1][:2] == [False, True]
