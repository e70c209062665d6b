"""n, logprobs, penalties, logit_bias, min_tokens and a grammar on the real model (SmolLM2, CPU): the engine,
the CUDA-graph static-buffer path (run eagerly), and both HTTP endpoints, raw and through the
official openai client. Every generation is a few tokens."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest
import torch
from starlette.testclient import TestClient

from qml_kernels.attention import AttentionMetadata
from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.constrained import json_schema_grammar
from qml_runtime.cuda_graphs import DecodeGraphs, PrefillGraphs
from qml_runtime.engine import Engine
from qml_runtime.kv.cache import KVCache
from qml_runtime.logits import apply_penalties
from qml_runtime.sampling_params import SamplingParams
from qml_server import create_app
from tests.test_server_api import assert_error, openai_client, sse_payloads
from tests.test_server_connections import serve_in_thread

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
REPEATS = [{"role": "user", "content": "Count: one one one one one"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def prompt(engine, messages=CAPITAL) -> list[int]:
    return engine.tokenizer.apply_chat_template(messages)


def model_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Raw logits at every position of one sequence [T, V], by one prefill through a private KV
    cache: independent of the engine's paging, batching, decode path and sampler."""
    S, T = 16, len(token_ids)
    pages = -(-T // S)
    kv = KVCache(engine.model_config, pages, S, engine.device, engine.dtype)
    meta = AttentionMetadata.build(list(range(T)), [list(range(pages))], [0, T], [T], engine.device)
    with torch.inference_mode():
        return engine.model.logits(engine.model(torch.tensor(token_ids), torch.arange(T), kv, meta))


# --- the engine -----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_models_log_softmax(engine, temperature):
    ids = prompt(engine)
    out = engine.generate_sync(ids, SamplingParams(max_tokens=4, temperature=temperature, seed=11, logprobs=5))
    assert len(out.logprobs) == len(out.token_ids) == 4
    logp = torch.log_softmax(model_logits(engine, ids + out.token_ids).float(), -1)[len(ids) - 1:-1]  # [4, V]
    for t, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == token
        assert abs(lp.logprob - logp[t, token].item()) < 1e-3  # raw: temperature does not enter
        values = [v for _, v in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True)
        assert [i for i, _ in lp.top] == logp[t].topk(5).indices.tolist()
        if temperature == 0:  # greedy: the sampled token is the argmax, listed first
            assert token == logp[t].argmax().item() == lp.top[0][0]
        if token == lp.top[0][0]:
            assert abs(lp.top[0][1] - lp.logprob) < 1e-6


def test_n_choices_share_the_prompt_and_have_their_own_seeds(engine):
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Invent a name for a cat."}])
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=2024)
    choices = engine.generate_sync(ids, params, n=3)
    again = engine.generate_sync(ids, params, n=3)
    assert [c.token_ids for c in choices] == [c.token_ids for c in again]  # reproducible with a seed
    assert len({tuple(c.token_ids) for c in choices}) > 1  # and different from each other
    assert choices[0].token_ids == engine.generate_sync(ids, params).token_ids  # choice 0 keeps the seed
    full_pages = (len(ids) - 1) // engine.blocks.block_size * engine.blocks.block_size
    assert all(c.cached_tokens == full_pages for c in choices[1:])  # the followers reuse the prompt's pages


def test_logit_bias_forces_and_bans(engine):
    ids = prompt(engine)
    plain = engine.generate_sync(ids, SamplingParams(max_tokens=3, temperature=0))
    forced = engine.tokenizer.encode("banana", add_special_tokens=False)[0]
    out = engine.generate_sync(ids, SamplingParams(max_tokens=3, temperature=0, logit_bias=((forced, 100.0),)))
    assert out.token_ids == [forced] * 3
    banned = plain.token_ids[0]
    out = engine.generate_sync(ids, SamplingParams(max_tokens=3, temperature=0.7, seed=5,
                                                   logit_bias=((banned, -100.0),)))
    assert banned not in out.token_ids


def test_min_tokens_delays_eos(engine):
    ids = prompt(engine)
    plain = engine.generate_sync(ids, SamplingParams(max_tokens=24, temperature=0))
    assert plain.finish_reason == "stop" and plain.token_ids[-1] in engine.tokenizer.eos_token_ids
    n = len(plain.token_ids)
    out = engine.generate_sync(ids, SamplingParams(max_tokens=n + 3, min_tokens=n + 2, temperature=0))
    assert out.token_ids[:n - 1] == plain.token_ids[:n - 1]  # the same answer up to where EOS came
    assert len(out.token_ids) >= n + 2 and not set(out.token_ids[:n + 1]) & engine.tokenizer.eos_token_ids


def test_penalties_steer_greedy_decoding_as_their_formulas_say(engine):
    ids = prompt(engine, REPEATS)
    plain = engine.generate_sync(ids, SamplingParams(max_tokens=6, temperature=0)).token_ids
    params = SamplingParams(max_tokens=6, temperature=0, presence_penalty=2.0, frequency_penalty=2.0,
                            repetition_penalty=1.2)
    out = engine.generate_sync(ids, params).token_ids
    most = max(plain.count(t) for t in plain)
    assert most >= 3 and max(out.count(t) for t in out) < most  # the repeats the penalties were for are gone
    # each greedy token is the argmax of the model's logits penalized for the tokens before it
    logits = model_logits(engine, ids + out).float()[len(ids) - 1:-1]  # [6, V]
    V = logits.shape[1]
    in_prompt = torch.zeros(V, dtype=torch.bool)
    in_prompt[ids] = True
    for t, token in enumerate(out):
        counts = torch.bincount(torch.tensor(out[:t], dtype=torch.int64), minlength=V)
        x = apply_penalties(logits[t:t + 1], counts[None], in_prompt[None], torch.tensor([2.0]), torch.tensor([2.0]),
                            torch.tensor([1.2]))
        assert x.argmax().item() == token, t


def test_graph_path_takes_the_logits_out_for_processed_rows(engine):
    """Decode batches through the CUDA graphs' static buffers (run eagerly on the CPU): rows that
    need processing or logprobs are sampled outside the graph from its logits, beside plain rows,
    with the same tokens and logprobs as the plain engine."""
    ids = [prompt(engine, [{"role": "user", "content": "Name a fruit."}]), prompt(engine, REPEATS), prompt(engine),
           prompt(engine, [{"role": "user", "content": "Describe a person."}])]
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    forced = engine.tokenizer.encode("banana", add_special_tokens=False)[0]
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=1),
              SamplingParams(max_tokens=6, temperature=0, logprobs=2, frequency_penalty=2.0, presence_penalty=2.0),
              SamplingParams(max_tokens=6, temperature=0, logit_bias=((forced, 100.0),), min_tokens=6),
              SamplingParams(max_tokens=6, temperature=0, grammar=json_schema_grammar(person))]
    results = {}
    for graphs in (False, True):
        eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="t", device=engine.device,
                     dtype=engine.dtype, cache=CacheConfig(block_size=16, num_blocks=64, enable_prefix_caching=False),
                     scheduler=SchedulerConfig(max_num_seqs=4))
        calls = []
        if graphs:
            eng.runner.graphs = DecodeGraphs(engine.model, eng.kv, engine.device, 4, eng.context_length,
                                             capture=False)
            eng.runner.prefill_graphs = PrefillGraphs(engine.model, eng.kv, engine.device, eng.context_length,
                                                      capture=False, buckets=(64,))
            run = eng.runner.graphs.run
            eng.runner.graphs.run = lambda seqs: calls.append(len(seqs)) or run(seqs)
        eng.start()
        try:
            with cf.ThreadPoolExecutor(4) as pool:
                results[graphs] = list(pool.map(lambda a: eng.generate_sync(*a), zip(ids, params)))
        finally:
            eng.shutdown()
        if graphs:
            assert calls and max(calls) > 1, "no batched decode step went through the graph path"
    penalized, biased, constrained = results[True][1:]
    unpenalized = engine.generate_sync(ids[1], SamplingParams(max_tokens=6, temperature=0))
    assert penalized.token_ids != unpenalized.token_ids and biased.token_ids == [forced] * 6
    assert constrained.text.startswith('{"name": "')  # the grammar's mask: the model alone answers in words
    eos = engine.tokenizer.eos_token_ids
    kept = penalized.token_ids[:-1] if penalized.token_ids[-1] in eos else penalized.token_ids  # EOS: no entry
    assert [lp.token_id for lp in penalized.logprobs] == kept
    for a, b in zip(results[False], results[True]):
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4


# --- the HTTP endpoints ---------------------------------------------------------------


def same_logprobs(a: list[dict], b: list[dict]) -> None:
    """Chat logprobs entries alike up to float noise: the prompt may come from the prefix cache in
    one run and be computed in the other, and a batch's shapes change the summation order."""
    assert [e["token"] for e in a] == [e["token"] for e in b]
    for x, y in zip(a, b):
        assert abs(x["logprob"] - y["logprob"]) < 1e-3
        assert len(x["top_logprobs"]) == len(y["top_logprobs"])
        for p, q in zip(x["top_logprobs"], y["top_logprobs"]):
            assert abs(p["logprob"] - q["logprob"]) < 1e-3


@pytest.fixture(scope="module")
def client(engine):
    # no lifespan: the session fixture owns the engine's start and shutdown
    return TestClient(create_app(engine))


def test_chat_n_and_logprobs(client, engine):
    body = {"messages": CAPITAL, "max_tokens": 4, "n": 2, "seed": 9, "temperature": 1.0, "logprobs": True,
            "top_logprobs": 3}
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"]["completion_tokens"] == 8 and data["usage"]["total_tokens"] == data["usage"][
        "prompt_tokens"] + 8
    for choice in data["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 4 and "".join(e["token"] for e in content) == choice["message"]["content"]
        for e in content:
            assert bytes(e["bytes"]) == e["token"].encode() and len(e["top_logprobs"]) == 3
            tops = [t["logprob"] for t in e["top_logprobs"]]
            assert tops == sorted(tops, reverse=True) and e["logprob"] <= tops[0] + 1e-6
    again = client.post(CHAT, json=body).json()["choices"]  # seeded: the same choices
    assert [c["message"] for c in again] == [c["message"] for c in data["choices"]]
    for a, b in zip(again, data["choices"]):
        same_logprobs(a["logprobs"]["content"], b["logprobs"]["content"])

    # streamed: per index, the same text and logprobs, one finish each, usage over both choices
    events = sse_payloads(client.post(CHAT, json=body | {"stream": True,
                                                         "stream_options": {"include_usage": True}}).text)
    chunks = [e for e in events[:-1] if e["choices"]]
    for i, choice in enumerate(data["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
        streamed = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        same_logprobs(streamed, choice["logprobs"]["content"])
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice["finish_reason"]]
    assert events[-2]["usage"]["completion_tokens"] == 8


def test_completions_legacy_logprobs(client, engine):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    choice = client.post(COMPLETIONS, json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["token_logprobs"]) == 4
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(4)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 2 and top[token] == value == max(top.values())  # greedy: the best one
    ids = engine.tokenizer.encode(body["prompt"])
    out_ids = [engine.tokenizer.encode(t, add_special_tokens=False)[0] for t in lp["tokens"]]
    logp = torch.log_softmax(model_logits(engine, ids + out_ids[:1]).float()[len(ids) - 1], -1)
    assert abs(lp["token_logprobs"][0] - logp[out_ids[0]].item()) < 1e-3
    events = sse_payloads(client.post(COMPLETIONS, json=body | {"stream": True}).text)[:-1]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert sum((p["tokens"] for p in parts), []) == lp["tokens"]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": CAPITAL, "logit_bias": {"999999": 5}}, "logit_bias"),  # outside the vocabulary
    (CHAT, {"messages": CAPITAL, "logit_bias": {"5": -100.5}}, "logit_bias.5"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
    (CHAT, {"messages": CAPITAL, "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    (CHAT, {"messages": CAPITAL, "n": 0}, "n"),
    (CHAT, {"messages": CAPITAL, "top_logprobs": 2}, "top_logprobs"),
])
def test_invalid_values_are_400s(client, path, body, param):
    error = assert_error(client.post(path, json=body), 400, "invalid_value", param)
    assert error["type"] == "invalid_request_error"


def test_openai_client_live(engine):
    with serve_in_thread(create_app(engine), lifespan="off") as base, httpx.Client(timeout=60) as http:
        oa = openai_client(http, base_url=f"{base}/v1")
        chat = oa.chat.completions.create(model=engine.model_id, messages=CAPITAL, max_tokens=3, n=2, seed=4,
                                          logprobs=True, top_logprobs=2, presence_penalty=0.5,
                                          logit_bias={"30": -100}, extra_body={"min_tokens": 2})
        assert len(chat.choices) == 2 and chat.usage.completion_tokens == 6
        entry = chat.choices[1].logprobs.content[0]
        assert isinstance(entry.logprob, float) and len(entry.top_logprobs) == 2
        text = oa.completions.create(model=engine.model_id, prompt="Paris is", max_tokens=2, temperature=0,
                                     logprobs=1, frequency_penalty=1.0)
        assert len(text.choices[0].logprobs.token_logprobs) == 2
        chunks = list(oa.chat.completions.create(model=engine.model_id, messages=CAPITAL, max_tokens=2, n=2,
                                                 stream=True, logprobs=True))
        assert {c.choices[0].index for c in chunks} == {0, 1}
        assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == 4
