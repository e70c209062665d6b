"""The CUDA-graph decode path's inputs, on CPU: static buffers, bucket padding and full-width
block tables give the same tokens as the plain path (the graphs themselves need a GPU; the
H200 run in benchmarks/engine_h200.py checks them there)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.cuda_graphs import DecodeGraphs, decode_buckets
from qml_runtime.engine import Engine
from qml_runtime.sampling_params import SamplingParams


@pytest.mark.parametrize("max_batch", [1, 3, 8, 64, 100, 256])
def test_buckets_cover_every_batch_size(max_batch):
    buckets = decode_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch and buckets[0] == 1
    for b in range(1, max_batch + 1):  # padding stays small: at most 2x at small sizes, +16 rows beyond
        pad = next(x for x in buckets if x >= b) - b
        assert pad <= max(b, 16)


def _engine(engine, graphs: bool, block_size: int = 16) -> Engine:
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="t", device=engine.device,
                 dtype=engine.dtype, cache=CacheConfig(block_size=block_size, num_blocks=200,
                                                       enable_prefix_caching=False),
                 scheduler=SchedulerConfig(max_num_seqs=6))
    if graphs:
        eng.runner.graphs = DecodeGraphs(engine.model, eng.kv, engine.device, 6, eng.context_length, capture=False)
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
    calls = []
    run = eng.runner.graphs.run
    eng.runner.graphs.run = lambda *a: calls.append(len(a[0])) or run(*a)
    padded = _run_concurrently(eng, prompts, params)
    assert calls and max(calls) > 1, "the static-buffer path did not run on batched decode"
    assert any(c not in eng.runner.graphs.buckets for c in calls), "no step needed padding"
    for a, b in zip(plain, padded):
        assert a.token_ids == b.token_ids and a.text == b.text
