"""The engine on the real model: stopping, limits, aborts, errors, chunked prefill and preemption."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time
from array import array

import pytest

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.engine import Engine
from qml_runtime.sampling_params import InvalidParameter, SamplingParams

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def chat(engine, content: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])


def sibling(engine, **kw) -> Engine:
    """Another engine over the same loaded model, with other cache/scheduler limits."""
    cache = kw.pop("cache", CacheConfig(block_size=16, num_blocks=256))
    sched = kw.pop("scheduler", SchedulerConfig())
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="sibling", device=engine.device,
                 dtype=engine.dtype, cache=cache, scheduler=sched)
    eng.start()
    return eng


def test_eos_stops_and_counts(engine):
    out = engine.generate_sync(engine.tokenizer.apply_chat_template(CAPITAL), GREEDY)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.tokenizer.eos_token_ids  # counted, but not turned into text
    assert out.completion_tokens == len(out.token_ids)
    assert out.prompt_tokens == len(engine.tokenizer.apply_chat_template(CAPITAL))


def test_max_tokens_gives_length(engine):
    out = engine.generate_sync(chat(engine, "Tell me a long story."), SamplingParams(max_tokens=3, temperature=0))
    assert out.finish_reason == "length" and out.completion_tokens == 3 and len(out.token_ids) == 3


def test_stop_string_cuts_text(engine):
    ids = engine.tokenizer.apply_chat_template(CAPITAL)
    out = engine.generate_sync(ids, SamplingParams(max_tokens=24, temperature=0, stop=("Paris",)))
    assert out.finish_reason == "stop"
    assert out.text == "The capital of France is "


def test_stop_token_ids(engine):
    ids = engine.tokenizer.apply_chat_template(CAPITAL)
    full = engine.generate_sync(ids, GREEDY)
    third = full.token_ids[2]
    out = engine.generate_sync(ids, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(third,)))
    assert out.token_ids == full.token_ids[:3] and out.finish_reason == "stop"


def test_seeded_sampling_reproduces(engine):
    ids = chat(engine, "Write a poem about the sea.")
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    a, b = engine.generate_sync(ids, params), engine.generate_sync(ids, params)
    assert a.token_ids == b.token_ids
    others = {tuple(engine.generate_sync(ids, SamplingParams(max_tokens=20, temperature=1.0, seed=s)).token_ids)
              for s in range(4)}
    assert len(others) > 1  # different seeds do sample differently


@pytest.mark.parametrize("prompt, params, param", [
    ([], GREEDY, "prompt"),
    ([1, 2, 10**9], GREEDY, "prompt"),  # a token id outside the vocabulary
    ([1, -2], GREEDY, "prompt"),
    ([1, 2.0], GREEDY, "prompt"),  # not an int
    ([1] * 8000, SamplingParams(max_tokens=500), "max_tokens"),  # over the 8192 context
    (array("I"), GREEDY, "prompt"),  # the uint32 arrays the server's chat prompts come as: checked too
    (array("I", [1, 2, 10**9]), GREEDY, "prompt"),
])
def test_bad_requests_raise_before_queueing(engine, prompt, params, param):
    with pytest.raises(InvalidParameter) as err:
        engine.generate_sync(prompt, params)
    assert err.value.param == param
    assert engine.generate_sync(engine.tokenizer.apply_chat_template(CAPITAL), GREEDY).finish_reason == "stop"


def test_a_uint32_array_prompt_is_taken_as_its_ids(engine):
    ids = engine.tokenizer.apply_chat_template(CAPITAL)
    out = engine.generate_sync(array("I", ids), GREEDY)
    assert out.token_ids == engine.generate_sync(ids, GREEDY).token_ids and out.prompt_tokens == len(ids)


def test_closing_the_stream_aborts_and_frees_pages(engine):
    async def first_output_then_leave():
        gen = engine.generate(chat(engine, "Count to one hundred."), SamplingParams(max_tokens=500, temperature=0))
        out = await gen.__anext__()
        await gen.aclose()
        return out

    free_before = engine.blocks.num_free
    out = asyncio.run(first_output_then_leave())
    assert not out.finished
    deadline = time.monotonic() + 10
    while engine.blocks.num_free != free_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.blocks.num_free == free_before and not engine.scheduler.has_work()


def test_chunked_prefill_matches_whole_prefill(engine):
    prompts = [chat(engine, q) for q in ("Explain photosynthesis briefly.", "What is 12 times 12?")]
    whole = [engine.generate_sync(p, GREEDY).token_ids for p in prompts]
    small = sibling(engine, scheduler=SchedulerConfig(max_batched_tokens=7))  # prompts cut into 7-token chunks
    try:
        assert [small.generate_sync(p, GREEDY).token_ids for p in prompts] == whole
    finally:
        small.shutdown()


def test_preemption_under_a_small_pool_keeps_outputs(engine):
    questions = ["Name three planets.", "What is the boiling point of water?", "Who wrote Hamlet?",
                 "Give me a synonym for happy.", "What colour is grass?"]
    prompts = [chat(engine, q) for q in questions]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = [engine.generate_sync(p, params).token_ids for p in prompts]
    # 10 pages x 16 = 160 tokens: not enough for five ~80-token sequences at once
    tight = sibling(engine, cache=CacheConfig(block_size=16, num_blocks=10))
    try:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: tight.generate_sync(p, params).token_ids, prompts))
        assert got == expected
        assert tight.blocks.num_free == 10
    finally:
        tight.shutdown()


def test_context_is_capped_by_the_pool(engine):
    tiny = sibling(engine, cache=CacheConfig(block_size=16, num_blocks=2))
    try:
        assert tiny.context_length == 32
        with pytest.raises(InvalidParameter, match=r"context length \(32\)"):
            tiny.generate_sync(chat(engine, "hello"), SamplingParams(max_tokens=64))
    finally:
        tiny.shutdown()


def test_a_scheduler_error_fails_the_requests_and_the_engine_keeps_serving(engine, monkeypatch):
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("scheduler bug")
        return real()

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    ids = engine.tokenizer.apply_chat_template(CAPITAL)
    with pytest.raises(RuntimeError, match="scheduler bug"):
        engine.generate_sync(ids, GREEDY)
    assert engine.generate_sync(ids, GREEDY).finish_reason == "stop"


def test_the_start_up_heap_is_frozen_while_serving(engine):
    """With ``freeze_heap`` (the default on a GPU) the objects alive at start leave the cyclic GC's
    generations until shutdown, so a full collection during a request walks only what requests made."""
    import gc

    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="frozen", device=engine.device,
                 dtype=engine.dtype, cache=CacheConfig(block_size=16, num_blocks=64),
                 scheduler=SchedulerConfig(max_num_seqs=2), freeze_heap=True)
    assert gc.get_freeze_count() == 0
    eng.start()
    try:
        assert gc.get_freeze_count() > 1000  # the model, the tokenizer, torch's and our modules
        out = eng.generate_sync(engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=3, temperature=0.0))
        assert out.token_ids
    finally:
        eng.shutdown()
    assert gc.get_freeze_count() == 0
    assert not Engine(engine.model, engine.tokenizer, engine.model_config, model_id="cpu", device=engine.device,
                      dtype=engine.dtype, cache=CacheConfig(block_size=16, num_blocks=64),
                      scheduler=SchedulerConfig(max_num_seqs=2)).freeze_heap  # off by default on CPU
