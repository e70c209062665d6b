"""Prefix caching: pages found again by content, verified by tokens, salted by tenant, evicted LRU."""

from __future__ import annotations

import pytest

from qml_runtime.config import SchedulerConfig
from qml_runtime.kv import prefix
from qml_runtime.kv.block_manager import BlockManager
from qml_runtime.sampling_params import SamplingParams
from qml_runtime.scheduler import Scheduler
from qml_runtime.sequence import Sequence

S = 16


def seq(tokens: list[int], salt: bytes = b"", name: str = "s") -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=8), detokenizer=None, salt=salt)


def run_to_end(sched: Scheduler, s: Sequence) -> None:
    """Schedule until the prompt is computed, naming pages as the engine does, then finish it."""
    sched.add(s)
    while s.num_computed < s.num_tokens:
        batch = sched.schedule()
        for q, n in zip(batch.seqs, batch.num_tokens):
            q.num_computed += n
            sched.commit(q)
    sched.finish(s, "stop")


def make(num_blocks: int = 16, budget: int = 1000, fp: bytes = b"model") -> Scheduler:
    return Scheduler(SchedulerConfig(max_batched_tokens=budget), BlockManager(num_blocks, S), fp)


def test_hash_chain_is_deterministic_and_order_sensitive():
    a = prefix.chain(list(range(48)), S, b"fp", b"")
    assert a == prefix.chain(list(range(48)), S, b"fp", b"") and len(a) == 3
    assert prefix.chain([1] * 16 + [2] * 16, S, b"fp", b"")[1] != prefix.chain([2] * 16 + [2] * 16, S, b"fp", b"")[1]
    assert prefix.chain(list(range(16)), S, b"fp", b"t1") != prefix.chain(list(range(16)), S, b"fp", b"t2")
    assert prefix.chain(list(range(16)), S, b"fp1", b"") != prefix.chain(list(range(16)), S, b"fp2", b"")
    # length-prefixed: moving bytes between fingerprint and salt changes the name
    assert prefix.block_hash(prefix.ROOT, [1], b"ab", b"c") != prefix.block_hash(prefix.ROOT, [1], b"a", b"bc")


def test_second_request_reuses_the_shared_prefix():
    sched = make()
    first = seq(list(range(40)))
    run_to_end(sched, first)
    second = seq(list(range(35)) + [999] * 10)  # shares two full pages (32 tokens) and 3 more tokens
    sched.add(second)
    batch = sched.schedule()
    assert second.num_cached == 32 and second.num_computed == 32
    assert batch.num_tokens == [45 - 32]
    assert sched.prefix_hits == 32 and sched.prefix_queries == 40 + 45


def test_fully_cached_prompt_still_computes_its_last_token():
    sched = make()
    run_to_end(sched, seq(list(range(32))))
    again = seq(list(range(32)))
    sched.add(again)
    batch = sched.schedule()
    # 32 tokens = 2 full pages, but the last token must run to give logits: only the first page is reused
    assert again.num_cached == 16 and batch.num_tokens == [16]


def test_tenants_never_share_pages():
    sched = make()
    run_to_end(sched, seq(list(range(40)), salt=b"tenant-a"))
    other = seq(list(range(40)), salt=b"tenant-b")
    sched.add(other)
    sched.schedule()
    assert other.num_cached == 0
    same = seq(list(range(40)), salt=b"tenant-a")
    sched.add(same)
    sched.schedule()
    assert same.num_cached == 32


def test_a_hash_collision_is_a_miss(monkeypatch):
    # every block gets the same (colliding) name (the scheduler names blocks in runs)
    monkeypatch.setattr("qml_runtime.scheduler.chain_packed",
                        lambda data, block_size, fp, salt, start: [b"x" * 32] * (len(data) // (4 * block_size)))
    sched = make()
    run_to_end(sched, seq(list(range(40))))
    impostor = seq(list(range(100, 140)))
    sched.add(impostor)
    sched.schedule()
    assert impostor.num_cached == 0
    half = seq(list(range(16)) + list(range(200, 224)))  # its first block is the cached one, its second is not
    sched.add(half)
    sched.schedule()
    assert half.num_cached == 16


def test_lookup_run_checks_every_block_s_tokens():
    blocks = BlockManager(8, S)
    a, b, c = list(range(16)), list(range(16, 32)), list(range(32, 48))
    for page, name, tokens in ((3, b"n0", a), (5, b"n1", b), (6, b"n2", c)):
        blocks.register(page, name, tuple(tokens))
    names, data = [b"n0", b"n1", b"n2"], prefix.pack(a + b + c)
    assert blocks.lookup_run(names, data) == [3, 5, 6]
    assert blocks.lookup_run([b"n0", b"zz", b"n2"], data) == [3]  # a name not cached ends the run
    # one token differs in block 1, under the same name (a collision): a miss, and the run ends there
    assert blocks.lookup_run(names, prefix.pack(a + [7] + b[1:] + c)) == [3]
    assert blocks.lookup_run(names, prefix.pack([7] + a[1:] + b + c)) == []
    assert blocks.lookup_run([], b"") == []


def test_known_chains_give_the_names_that_chain_gives():
    import random

    rng = random.Random(5)
    fp = b"fp"
    known = prefix.KnownChains(S, max_blocks=1000)
    turn1 = [rng.randrange(2**31) for _ in range(16 * 10)]
    names1 = prefix.chain(turn1, S, fp, b"a")
    known.add(b"a", prefix.pack(turn1), names1)
    turn2 = turn1 + [rng.randrange(2**31) for _ in range(16 * 3)]
    assert known.names(b"a", prefix.pack(turn2)) == names1  # its first 10 blocks: the rest is hashed
    assert known.names(b"b", prefix.pack(turn2)) == []  # another tenant's salt: nothing
    edited = turn1[:16 * 4 + 3] + [7] + turn1[16 * 4 + 4:]  # differs in block 4
    assert known.names(b"a", prefix.pack(edited)) == names1[:4] == prefix.chain(edited, S, fp, b"a")[:4]
    assert known.names(b"a", prefix.pack(turn1[:16 * 6 + 5])) == names1[:6]  # shorter: its whole blocks
    assert known.names(b"a", prefix.pack([1] * 16 + turn1[16:])) == []  # another first block
    # the next turn replaces the entry its tokens extend; another conversation with the same first block
    # (a shared system prompt) is kept beside it, and the oldest keys go past the bound
    known.add(b"a", prefix.pack(turn2), prefix.chain(turn2, S, fp, b"a"))
    assert known.num_blocks == 13
    fork = turn1[:16] + [rng.randrange(2**31) for _ in range(16 * 4)]
    known.add(b"a", prefix.pack(fork), prefix.chain(fork, S, fp, b"a"))
    assert known.num_blocks == 18
    assert known.names(b"a", prefix.pack(fork)) == prefix.chain(fork, S, fp, b"a")
    assert known.names(b"a", prefix.pack(turn2)) == prefix.chain(turn2, S, fp, b"a")
    small = prefix.KnownChains(S, max_blocks=12)
    for first in range(3):
        tokens = [first] * 16 * 5
        small.add(b"", prefix.pack(tokens), prefix.chain(tokens, S, fp, b""))
    assert small.num_blocks == 10 and small.names(b"", prefix.pack([0] * 16 * 5)) == []
    with pytest.raises(ValueError):
        small.add(b"", prefix.pack(turn1), names1[:3])  # names that do not cover the tokens


def test_next_turn_copies_known_names_and_hashes_only_its_new_blocks(monkeypatch):
    import random

    rng = random.Random(7)
    sched = make(num_blocks=64)
    first = seq([rng.randrange(512) for _ in range(16 * 20 + 5)], salt=b"t")
    run_to_end(sched, first)  # 20 full pages named; its names kept when it finishes
    hashed = []
    chain_packed = prefix.chain_packed
    monkeypatch.setattr("qml_runtime.scheduler.chain_packed",
                        lambda data, *args, **kw: hashed.append(len(data)) or chain_packed(data, *args, **kw))
    tokens = first.token_ids + [rng.randrange(512) for _ in range(40)]  # 365 tokens: 22 blocks
    # packed by the engine's check of the prompt (the other sequences below pack their own)
    nxt = Sequence("nxt", tokens, SamplingParams(max_tokens=8), detokenizer=None, salt=b"t",
                   packed_prompt=prefix.pack(tokens))
    sched.add(nxt)
    sched.schedule()
    assert nxt.block_names == prefix.chain(nxt.token_ids[:22 * S], S, b"model", b"t")
    assert hashed == [2 * S * 4]  # the 2 new blocks only
    assert nxt.num_cached == 20 * S  # the same hits as with every name hashed
    other = seq(list(nxt.token_ids), salt=b"u")  # another tenant, the same tokens: all hashed, nothing shared
    sched.add(other)
    sched.schedule()
    assert hashed[-1] == 22 * S * 4 and other.num_cached == 0
    assert other.block_names == prefix.chain(other.token_ids[:22 * S], S, b"model", b"u")
    with pytest.raises(ValueError):
        Sequence("bad", tokens, SamplingParams(), detokenizer=None, packed_prompt=prefix.pack(tokens[1:]))


def test_cached_pages_are_evicted_oldest_first_and_reported():
    sched = make(num_blocks=6)
    evicted = []
    sched.blocks.on_evict = lambda pages: evicted.extend(tokens[0] for _, _, tokens in pages)
    run_to_end(sched, seq(list(range(0, 33)), name="a"))  # 3 pages, 2 full and named
    run_to_end(sched, seq(list(range(100, 133)), name="b"))  # 3 more: the pool is full of cached pages
    assert sched.blocks.num_cached == 4 and sched.blocks.num_free == 6
    run_to_end(sched, seq(list(range(200, 233)), name="c"))  # needs 3 pages: a's partial page, then a's named ones
    assert evicted[:2] == [16, 0]  # a's tail page goes before its head
    hit = seq(list(range(100, 133)), name="b2")
    sched.add(hit)
    sched.schedule()
    assert hit.num_cached == 32  # b, used later than a, survived


def test_shared_pages_are_counted_and_freed_once():
    sched = make(num_blocks=8)
    run_to_end(sched, seq(list(range(40))))
    a, b = seq(list(range(40)) + [1], name="a"), seq(list(range(40)) + [2], name="b")
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert a.block_table[:2] == b.block_table[:2]  # the same physical pages
    assert sched.blocks.ref[a.block_table[0]] == 2
    sched.finish(a, "stop")
    sched.finish(b, "stop")
    assert sched.blocks.num_free == 8


@pytest.fixture(scope="module")
def conversation(engine):
    tok = engine.tokenizer
    turn1 = [{"role": "user", "content": "Name three colours."}]
    ids1 = tok.apply_chat_template(turn1)
    out1 = engine.generate_sync(ids1, SamplingParams(max_tokens=40, temperature=0))
    turn2 = turn1 + [{"role": "assistant", "content": out1.text},
                     {"role": "user", "content": "Now name three animals."}]
    return ids1 + out1.token_ids, tok.apply_chat_template(turn2)


def test_next_turn_prefills_only_the_new_tokens(engine, conversation):
    history, ids2 = conversation
    shared = next(i for i, (a, b) in enumerate(zip(history + [-1], ids2)) if a != b)
    assert shared > 40  # the template re-renders the first turn and the answer token for token
    params = SamplingParams(max_tokens=24, temperature=0)
    out = engine.generate_sync(ids2, params)
    assert out.cached_tokens == shared // S * S
    engine.scheduler.prefix_caching = False
    try:
        uncached = engine.generate_sync(ids2, params)
    finally:
        engine.scheduler.prefix_caching = True
    assert uncached.cached_tokens == 0
    assert out.token_ids == uncached.token_ids  # reused KV gives the same answer as recomputed KV


def test_other_tenant_gets_no_hit(engine, conversation):
    _, ids2 = conversation
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.generate_sync(ids2, params, tenant="key-a")
    assert engine.generate_sync(ids2, params, tenant="key-b").cached_tokens == 0
    assert engine.generate_sync(ids2, params, tenant="key-a").cached_tokens > 0


def test_session_pages_are_evicted_last():
    sched = make(num_blocks=6)
    kept = seq(list(range(0, 33)), name="session")
    kept.retain = True
    run_to_end(sched, kept)  # 2 named pages, retained
    run_to_end(sched, seq(list(range(100, 133)), name="anon"))  # 2 named pages, ordinary
    run_to_end(sched, seq(list(range(200, 233)), name="newcomer"))  # needs 3 pages: the anonymous ones go
    hit = seq(list(range(0, 33)), name="session-again")
    sched.add(hit)
    sched.schedule()
    assert hit.num_cached == 32


def test_chain_names_blocks_as_block_hash_does_from_any_starting_block():
    import random

    from qml_runtime.kv.prefix import ROOT, block_hash, chain

    rng = random.Random(3)
    tokens = [rng.randrange(2**31) for _ in range(16 * 9 + 5)]  # 9 full blocks and a partial one
    fp, salt = bytes(range(32)), b"tenant-a"
    one_by_one, parent = [], ROOT
    for i in range(9):
        parent = block_hash(parent, tokens[i * 16:(i + 1) * 16], fp, salt)
        one_by_one.append(parent)
    assert chain(tokens, 16, fp, salt) == one_by_one
    assert chain(tokens, 16, fp, salt, start=one_by_one[3], first_block=4) == one_by_one[4:]
    assert chain(tokens, 16, fp, salt, start=one_by_one[-1], first_block=9) == []
    assert chain(tokens, 16, fp, b"tenant-b") != one_by_one  # the salt is in every link


@pytest.mark.parametrize("held", [False, True], ids=["cached-pages-free", "cached-pages-held"])
def test_admission_fit_counts_free_cached_pages_once(held):
    """A turn whose cached prefix sits on free pages takes them out of the free pool: it fits when the rest of
    the pool holds its new pages, exactly, and waits when one page short; pages another request holds are not
    taken out again."""
    prefix_tokens = list(range(64))  # 4 full pages
    for extra_pages, fits in ((0, True), (1, False)):
        sched = make(num_blocks=8)
        run_to_end(sched, seq(prefix_tokens + [7]))  # the prefix cached, its pages free (5 released)
        if held:  # another turn of the same prefix runs, holding those 4 pages and one of its own
            other = seq(prefix_tokens + [8], name="other")
            sched.add(other)
            sched.schedule()
            assert len(other.block_table) == 5 and sched.blocks.num_free == 3
        free = sched.blocks.num_free
        room = free - (0 if held else 4)  # pages left for the new turn's own tokens
        turn = seq(prefix_tokens + [9] * (16 * (room + extra_pages)), name="turn")
        sched.add(turn)
        batch = sched.schedule()
        assert (turn in batch.seqs) is fits, (held, extra_pages, free)
        if fits:
            assert turn.num_cached == 64 and len(turn.block_table) == 4 + room
