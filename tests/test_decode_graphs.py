"""The CUDA-graph paths' inputs, on CPU: static buffers, bucket padding (decode batches and
single-prompt prefills, with the padding as a second sequence), full-width block tables and
in-graph sampling give the same tokens as the plain path. The graphs themselves need a GPU;
benchmarks/engine_h200.py checks them on the H200."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.cuda_graphs import DecodeGraphs, PrefillGraphs, decode_buckets
from qml_runtime.engine import Engine
from qml_runtime.sampling_params import SamplingParams


@pytest.mark.parametrize("max_batch", [1, 3, 8, 64, 100, 256])
def test_buckets_cover_every_batch_size(max_batch):
    buckets = decode_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch and buckets[0] == 1
    for b in range(1, max_batch + 1):  # padding stays small: at most 2x at small sizes, +16 rows beyond
        pad = next(x for x in buckets if x >= b) - b
        assert pad <= max(b, 16)


def _engine(engine, graphs: bool, block_size: int = 16, prefix_caching: bool = False) -> Engine:
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="t", device=engine.device,
                 dtype=engine.dtype, cache=CacheConfig(block_size=block_size, num_blocks=200,
                                                       enable_prefix_caching=prefix_caching),
                 scheduler=SchedulerConfig(max_num_seqs=6))
    if graphs:
        eng.runner.graphs = DecodeGraphs(engine.model, eng.kv, engine.device, 6, eng.context_length, capture=False)
        # small buckets, so prompts pad, and longer ones than the largest run eagerly
        eng.runner.prefill_graphs = PrefillGraphs(engine.model, eng.kv, engine.device, eng.context_length,
                                                  capture=False, buckets=(8, 16, 40))
    return eng


def _run_concurrently(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    eng.start()
    try:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda a: eng.generate_sync(*a), zip(prompts, params)))
    finally:
        eng.shutdown()


def test_padded_static_decode_matches_plain_decode(engine):
    tok = engine.tokenizer
    texts = ["Hi", "Name three colours.", "Write a haiku about the sea and the moon.", "What is 2 + 2?",
             "Tell me about Paris in two sentences."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    # greedy and seeded sampling: the sampler sees the same logits and the same (seed, step)
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(len(texts))]
    plain = _run_concurrently(_engine(engine, graphs=False), prompts, params)
    eng = _engine(engine, graphs=True, block_size=8)  # small pages: tables grow during decode
    calls, prefills, overlapped = [], [], []
    run, prefill = eng.runner.graphs.run, eng.runner.prefill_graphs.run
    eng.runner.graphs.run = lambda seqs, prev=None: (calls.append(len(seqs)), overlapped.append(prev is not None),
                                                     run(seqs, prev))[-1]
    eng.runner.prefill_graphs.run = lambda seq, n: prefills.append(n) or prefill(seq, n)
    padded = _run_concurrently(eng, prompts, params)
    assert calls and max(calls) > 1, "the static-buffer path did not run on batched decode"
    assert any(c not in eng.runner.graphs.buckets for c in calls), "no decode step needed padding"
    assert any(overlapped), "no decode step was launched behind the one before (overlap)"
    for a, b in zip(plain, padded):
        assert a.token_ids == b.token_ids and a.text == b.text


def test_padded_single_prompt_prefill_matches_plain(engine):
    """Prompts one at a time (each alone in its step): those up to the largest bucket go through
    the padded prefill path, longer ones run eagerly; the tokens match the plain engine's."""
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in ("Hi", "Name a colour.")]
    prompts.append(prompts[1][:-3])  # a raw prefix: another length
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    outs = {}
    for graphs in (False, True):
        eng = _engine(engine, graphs=graphs)
        seen = []
        if graphs:
            prefill = eng.runner.prefill_graphs.run
            eng.runner.prefill_graphs.run = lambda seq, n: seen.append(n) or prefill(seq, n)
        eng.start()
        try:
            outs[graphs] = [eng.generate_sync(p, greedy).token_ids for p in prompts]
        finally:
            eng.shutdown()
        if graphs:
            assert seen and any(n not in (8, 16, 40) for n in seen), "no prompt went through a padded bucket"
    assert outs[True] == outs[False]


def test_padded_prefill_over_a_cached_prefix_matches_plain(engine):
    """Turn 2 of a conversation: its new tokens go through the padded prefill path on top of
    the pages turn 1 left in the prefix cache."""
    tok = engine.tokenizer
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    outputs = {}
    for graphs in (False, True):
        eng = _engine(engine, graphs=graphs, prefix_caching=True)
        eng.start()
        try:
            messages = [{"role": "user", "content": "Name a fruit."}]
            first = eng.generate_sync(tok.apply_chat_template(messages), greedy)
            messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Another?"}]
            ids = tok.apply_chat_template(messages)
            if graphs:
                seen = []
                prefill = eng.runner.prefill_graphs.run
                eng.runner.prefill_graphs.run = lambda seq, n: seen.append((seq.num_computed, n)) or prefill(seq, n)
            second = eng.generate_sync(ids, greedy)
            assert second.cached_tokens > 0
            if graphs:
                assert any(start > 0 for start, _ in seen), "turn 2 did not go through the padded prefill path"
            outputs[graphs] = (first.token_ids, second.token_ids)
        finally:
            eng.shutdown()
    assert outputs[True] == outputs[False]


def test_prefill_graphs_for_short_and_long_contexts(engine):
    """Small buckets get a graph for contexts that fit in them (fresh prompts: the attention's split
    count chosen for a short band) and one for long contexts (a turn over a cached history); larger
    buckets only the long one. A prompt takes the short graph only when its whole context fits."""
    eng = _engine(engine, graphs=False)
    graphs = PrefillGraphs(engine.model, eng.kv, engine.device, eng.context_length, capture=False,
                           buckets=(16, 512, 1024, 2048))
    assert graphs.keys() == [(16, False), (16, True), (512, False), (512, True), (1024, False), (1024, True),
                             (2048, True)]
    assert graphs.key(10, 10) == (16, False)  # fresh
    assert graphs.key(10, 16) == (16, False)  # a short cached prefix: still within the bucket
    assert graphs.key(10, 17) == (16, True)
    assert graphs.key(300, 27_000) == (512, True)  # a turn over a long history
    assert graphs.key(1024, 1024) == (1024, False)
    assert graphs.key(1500, 1500) == (2048, True)  # past PREFILL_SHORT_MAX: the one graph


def test_a_long_chunk_over_a_long_context_runs_eagerly_where_the_chunk_path_serves_it(engine, monkeypatch):
    """Turn 2's new tokens over turn 1's cached pages: through the prefill graph as a rule, but eagerly when the
    chunk is long, its context long, and qml_kernels.attention_chunk available (thresholds made small here); the
    tokens are the same either way."""
    from qml_kernels import attention_chunk
    from qml_runtime import runner as runner_module

    tok = engine.tokenizer
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    monkeypatch.setattr(runner_module, "CHUNK_EAGER_TOKENS", 8)
    monkeypatch.setattr(runner_module, "CHUNK_EAGER_CONTEXT", 16)
    monkeypatch.setattr(attention_chunk, "available", lambda: True)
    outputs = {}
    for eager_chunks in (False, True):
        eng = _engine(engine, graphs=True, prefix_caching=True)
        eng.runner.eager_long_chunks = eager_chunks
        eng.start()
        try:
            messages = [{"role": "user", "content": "Name a fruit, then a vegetable."}]
            first = eng.generate_sync(tok.apply_chat_template(messages), greedy)
            messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Another?"}]
            seen = []
            prefill = eng.runner.prefill_graphs.run
            eng.runner.prefill_graphs.run = lambda seq, n: seen.append((seq.num_computed, n)) or prefill(seq, n)
            second = eng.generate_sync(tok.apply_chat_template(messages), greedy)
            assert second.cached_tokens >= 16
            through_graph = [n for start, n in seen if start > 0 and n > 1]
            assert bool(through_graph) != eager_chunks, (eager_chunks, seen)
            outputs[eager_chunks] = second.token_ids
        finally:
            eng.shutdown()
    assert outputs[True] == outputs[False]
