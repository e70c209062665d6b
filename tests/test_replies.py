"""Kept replies (qml_server.replies): a reply's generated ids are found again when the client sends it back."""

from __future__ import annotations

import random
from array import array

import pytest
from starlette.testclient import TestClient

from qml_runtime.config import CacheConfig
from qml_runtime.presets import ByteTokenizer, load_preset_engine
from qml_server.app import create_app
from qml_server.generation import _ids_of_text
from qml_server.replies import ReplyMemory
from qml_server.replies_store import ReplyStore
from tests.test_engine import sibling

# --- the memory ---------------------------------------------------------------------------


def prefix(memory: ReplyMemory, tenant: str, text: str) -> tuple[int, list[int]] | None:
    """``longest_prefix`` with its ids as a list (it hands them out as the engine takes them: uint32)."""
    found = memory.longest_prefix(tenant, text)
    if found is None:
        return None
    chars, ids = found
    assert isinstance(ids, array) and ids.typecode == "I"
    return chars, ids.tolist()


def test_the_longest_kept_prefix_of_the_same_tenant_wins():
    m = ReplyMemory()
    m.remember("a", "hello", [1, 2])
    m.remember("a", "hello world", [1, 2, 3])  # extends "hello": one entry, both cut points
    m.remember("a", "bye", [9])
    m.remember("b", "hello world, again", [7, 7, 7])
    assert len(m) == 3 and m.tokens == 7
    assert prefix(m, "a", "hello world, again") == (11, [1, 2, 3])
    assert prefix(m, "a", "hello there") == (5, [1, 2])  # a turn sent again finds the earlier cut
    assert prefix(m, "a", "hell") is None
    assert prefix(m, "b", "hello world, again!") == (18, [7, 7, 7])
    assert prefix(m, "c", "hello world") is None  # another tenant's replies are never used
    assert prefix(m, "a", "bye") == (3, [9])  # the whole text: nothing left to encode
    assert m.stats() == {"entries": 3, "tokens": 7, "hits": 4, "misses": 2, "reused_tokens": 9}
    # a text that extends a kept one with other ids (encoded apart, after an eviction) is kept beside it
    m.remember("a", "hello world and more", [5, 5, 5, 5])
    assert len(m) == 4 and prefix(m, "a", "hello world and more!") == (20, [5, 5, 5, 5])
    assert prefix(m, "a", "hello world!") == (11, [1, 2, 3])


def test_bounds_drop_the_least_recently_used():
    m = ReplyMemory(max_entries=3, max_tokens=10)
    for i in range(3):
        m.remember("t", f"text {i}", [i, i])
    assert prefix(m, "t", "text 0 and more") is not None  # 0 is now the most recent
    m.remember("t", "text 3", [3, 3])
    assert len(m) == 3 and prefix(m, "t", "text 1...") is None  # 1 was the least recent
    m.remember("t", "long", list(range(9)))  # 6 + 9 > 10 ids: the least recent go until it fits
    assert m.tokens <= 10 and prefix(m, "t", "long one") == (4, list(range(9)))
    m.remember("t", "too long", list(range(11)))  # more than the whole budget: not kept
    assert prefix(m, "t", "too long") is None
    with pytest.raises(ValueError):
        ReplyMemory(max_entries=0)


def test_a_uint32_array_is_kept_as_its_ids():
    m = ReplyMemory()
    m.remember("a", "hello", array("I", [1, 2, 70000]))  # as the server's chat prompts come
    m.remember("a", "hello world", [1, 2, 70000, 3])
    assert prefix(m, "a", "hello!") == (5, [1, 2, 70000]) and prefix(m, "a", "hello world!") == (11, [1, 2, 70000, 3])
    assert m.tokens == 4


def test_a_random_workload_matches_a_plain_model_and_respects_the_bounds():
    rng = random.Random(0)
    m = ReplyMemory(max_entries=8, max_tokens=60)
    for _ in range(2000):
        tenant = rng.choice("xy")
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        if rng.random() < 0.5:
            m.remember(tenant, text, [rng.randrange(100) for _ in range(rng.randint(1, 12))])
            assert len(m) <= 8 and m.tokens <= 60 and m.tokens == sum(len(e.ids) for e in m._entries.values())
        else:
            cuts = [(c, n, e) for e in m._entries.values() if e.tenant == tenant for c, n in e.cuts
                    if text.startswith(e.text[:c])]
            want = max(cuts, key=lambda cut: cut[0], default=None)
            got = prefix(m, tenant, text)
            assert got == (None if want is None else (want[0], want[2].ids[:want[1]].tolist()))


def test_the_ids_of_a_replys_text():
    tok = ByteTokenizer(512)
    e_acute = list("é".encode())  # two bytes
    # a character cut off by the reply's end: the text leaves it out, so do the kept ids
    assert _ids_of_text(tok, [104, 105, e_acute[0]], "hi") == [104, 105]
    # a trailing special token (BOS stands in for an EOS here) writes no text: dropped
    assert _ids_of_text(tok, [104, 105, 256], "hi") == [104, 105]
    # a special token inside the reply stays: it is what the model generated
    assert _ids_of_text(tok, [104, 256, 105], "hi") == [104, 256, 105]
    assert _ids_of_text(tok, [300, 301], tok.decode([300, 301])) == [300, 301]
    # a stop string that began inside a token: no head of the ids writes the text
    assert _ids_of_text(tok, [400, 401], "x") is None


# --- on disk ------------------------------------------------------------------------------


def test_kept_replies_survive_a_restart_and_damaged_files_are_misses(tmp_path):
    store = ReplyStore(tmp_path)
    m = ReplyMemory(store=store)
    m.remember("a", "hello", [1, 2])
    m.remember("a", "hello world", [1, 2, 3])  # replaces the first file
    m.remember("b", "héllo 🙂", [4])
    store.flush()
    assert len(list(tmp_path.glob("*.rep"))) == 2
    again = ReplyMemory(store=ReplyStore(tmp_path))
    assert prefix(again, "a", "hello there") == (5, [1, 2])
    assert prefix(again, "a", "hello world!") == (11, [1, 2, 3])
    assert prefix(again, "b", "héllo 🙂 ok") == (7, [4])
    # a truncated file, a flipped bit, a stray file and an interrupted write: deleted on load, never raised
    files = sorted(tmp_path.glob("*.rep"))
    files[0].write_bytes(files[0].read_bytes()[:-5])
    data = bytearray(files[1].read_bytes())
    data[20] ^= 1
    files[1].write_bytes(bytes(data))
    (tmp_path / ("0" * 64 + ".rep")).write_bytes(b"QMLRPLY1junk")
    (tmp_path / ".x.rep.1.tmp").write_bytes(b"partial")
    damaged = ReplyMemory(store=ReplyStore(tmp_path))
    assert len(damaged) == 0 and not list(tmp_path.iterdir())
    # bounds hold on load too: the least recently written go (and their files with them)
    bounded = ReplyMemory(store=ReplyStore(tmp_path))
    for i in range(4):
        bounded.remember("t", f"text {i}", [i])
    bounded.store.flush()
    small = ReplyMemory(max_entries=2, store=ReplyStore(tmp_path))
    small.store.flush()
    assert [prefix(small, "t", f"text {i}") for i in range(4)] == [None, None, (6, [2]), (6, [3])]
    assert len(list(tmp_path.glob("*.rep"))) == 2


# --- through the chat route ---------------------------------------------------------------


def tiny_app(keep_replies: bool = True):
    engine = load_preset_engine("preset:tiny-llama", True, device="cpu", kv_cache_gib=0.02)
    return create_app(engine, keep_replies=keep_replies)


def chat(client, messages, **kw):
    body = {"model": client.app.state.engine.model_id, "messages": messages, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, **kw}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def two_turns(client, **kw):
    first = [{"role": "user", "content": "Tell me a story about a lighthouse keeper. " * 4}]
    r1 = chat(client, first, **kw)
    second = first + [r1["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    return r1, second, chat(client, second, **kw)


@pytest.mark.parametrize("keep", [True, False])
def test_the_next_turn_reuses_the_replys_kv_only_with_kept_replies(keep):
    # the random model's ids never survive decode + encode (ids past 256 decode to filler letters)
    with TestClient(tiny_app(keep)) as client:
        r1, second, r2 = two_turns(client)
        prompt1 = r1["usage"]["prompt_tokens"]
        cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        tok = client.app.state.engine.tokenizer
        canonical = len(tok.apply_chat_template(second))
        if keep:
            # the first prompt and (up to a cut-off character) its 24 generated ids, less the last token,
            # whose KV is never written: all in full pages of 16
            assert cached >= (prompt1 + 24 - 4 - 1) // 16 * 16 > prompt1 // 16 * 16
            assert client.app.state.replies.stats()["hits"] == 1
            # /tokenize counts the prompt as the chat route encoded it (same tenant)
            count = client.post("/tokenize", json={"messages": second}).json()["count"]
            assert count == r2["usage"]["prompt_tokens"] != canonical
            metrics = client.get("/metrics").text
            assert 'qml:kept_reply_hits_total{model_name="tiny-llama-random"} 2.0' in metrics  # chat, /tokenize
            assert 'qml:kept_replies{model_name="tiny-llama-random"} 1.0' in metrics  # one conversation
        else:
            assert client.app.state.replies is None
            assert cached <= prompt1 // 16 * 16 + 16 and r2["usage"]["prompt_tokens"] == canonical


def test_another_tenant_sending_the_same_history_gets_it_encoded_from_text():
    with TestClient(tiny_app()) as client:
        _, second, r2 = two_turns(client, cache_salt="alice")
        other = chat(client, second, cache_salt="mallory")
        canonical = len(client.app.state.engine.tokenizer.apply_chat_template(second))
        assert r2["usage"]["prompt_tokens"] != canonical == other["usage"]["prompt_tokens"]
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_smollm_turn_two_has_the_same_greedy_text_with_the_cache_disabled(engine):
    """The real tokenizer: the reply's ids come back, its KV is hit, and the text is what the same ids give
    with no prefix cache at all."""
    cached_engine = sibling(engine)
    uncached_engine = sibling(engine, cache=CacheConfig(block_size=16, num_blocks=256, enable_prefix_caching=False))
    results = []
    for eng in (cached_engine, uncached_engine):
        with TestClient(create_app(eng)) as client:
            first = [{"role": "user", "content": "Name three colours."}]
            r1 = chat(client, first, max_tokens=32, ignore_eos=False)
            second = first + [r1["choices"][0]["message"], {"role": "user", "content": "And three animals?"}]
            r2 = chat(client, second, max_tokens=16, ignore_eos=False)
            results.append((r1, r2, client.app.state.replies.stats()))
    (r1, r2, stats), (u1, u2, _) = results
    assert r2["choices"][0]["message"] == u2["choices"][0]["message"]
    assert r2["usage"]["prompt_tokens"] == u2["usage"]["prompt_tokens"]
    assert stats["hits"] == 1
    # the first prompt and the reply (less its EOS, and the last token's unwritten KV), in full pages
    kept = r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"] - 2
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= kept // 16 * 16
    assert u2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
