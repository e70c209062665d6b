"""Overlapped decode: the engine launches the next decode step before the tokens of the one in
flight are known (each sequence's last token a placeholder until they are), and wastes the rows
of sequences that stop in between. On CPU the decode graphs run their static-buffer path eagerly,
which is the same code with the same inputs; what is checked is that overlap changes nothing a
client sees, and that no page is lost."""

from __future__ import annotations

import concurrent.futures as cf
import threading

from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.cuda_graphs import DecodeGraphs
from qml_runtime.engine import Engine
from qml_runtime.kv.block_manager import BlockManager
from qml_runtime.sampling_params import SamplingParams
from qml_runtime.scheduler import Scheduler
from qml_runtime.sequence import Sequence, Status


def _engine(engine, overlap: bool, block_size: int = 4, num_blocks: int = 400) -> Engine:
    eng = Engine(engine.model, engine.tokenizer, engine.model_config, model_id="t", device=engine.device,
                 dtype=engine.dtype, cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                       enable_prefix_caching=True),
                 scheduler=SchedulerConfig(max_num_seqs=8), overlap=overlap)
    eng.runner.graphs = DecodeGraphs(engine.model, eng.kv, engine.device, 8, eng.context_length, capture=False)
    return eng


def _run(eng: Engine, jobs: list[tuple[list[int], SamplingParams, int]]) -> list:
    eng.start()
    try:
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda job: eng.generate_sync(job[0], job[1], n=job[2]), jobs))
    finally:
        eng.shutdown()


def _flat(results) -> list:
    out = []
    for r in results:
        out += r if isinstance(r, list) else [r]
    return [(o.token_ids, o.text, o.finish_reason, o.completion_tokens) for o in out]


def test_overlap_changes_no_output(engine):
    tok = engine.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": t}])
            for t in ("Hi", "Name three colours.", "Write a haiku about the sea.", "What is 2 + 2?")]
    probe = _run(_engine(engine, overlap=False), [(chat[1], SamplingParams(max_tokens=12, temperature=0.0), 1)])[0]
    stop_id = probe.token_ids[5]  # a token the greedy answer reaches mid-way: it stops there
    stop_text = tok.decode(probe.token_ids[3:5]).strip() or "e"
    jobs = [
        (chat[0], SamplingParams(max_tokens=1, temperature=0.0), 1),  # ends on its first token
        (chat[0], SamplingParams(max_tokens=2, temperature=0.0), 1),  # ends one decode step in
        (chat[1], SamplingParams(max_tokens=3, temperature=0.0), 1),
        (chat[1], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop_id,)), 1),
        (chat[1], SamplingParams(max_tokens=30, temperature=0.0, stop=(stop_text,)), 1),
        (chat[2], SamplingParams(max_tokens=40, temperature=0.9, seed=7), 2),  # n=2: a follower
        (chat[3], SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True), 1),
        (chat[2], SamplingParams(max_tokens=33, temperature=0.7, top_p=0.9, seed=3), 1),
    ]
    plain = _run(_engine(engine, overlap=False), jobs)
    eng = _engine(engine, overlap=True)
    behind = []
    run = eng.runner.graphs.run
    eng.runner.graphs.run = lambda seqs, prev=None: (behind.append(prev is not None), run(seqs, prev))[-1]
    overlapped = _run(eng, jobs)
    assert sum(behind) > 10, "few decode steps were launched behind another"
    assert _flat(overlapped) == _flat(plain)
    assert eng.blocks.num_free == eng.blocks.num_blocks, "pages still held after every request finished"
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_the_next_turn_finds_the_pages_named_during_overlap(engine):
    """Pages filled while a step ran behind another are named with real tokens (not the placeholder):
    the conversation's next turn finds them in the prefix cache."""
    tok = engine.tokenizer
    eng = _engine(engine, overlap=True)
    eng.start()
    try:
        messages = [{"role": "user", "content": "Count from one to twenty in words."}]
        first = eng.generate_sync(tok.apply_chat_template(messages), SamplingParams(max_tokens=40, temperature=0.0))
        history = tok.apply_chat_template(messages) + first.token_ids
        second = eng.generate_sync(history + tok.encode(" And on?"), SamplingParams(max_tokens=4, temperature=0.0))
    finally:
        eng.shutdown()
    # every full page of the history, generated tokens included, came from the cache
    assert second.cached_tokens >= (len(history) - 1) // 4 * 4 - 4, (second.cached_tokens, len(history))


def test_abort_while_a_step_is_in_flight(engine):
    """A client that goes away mid-stream: its rows in flight are dropped, its pages come back,
    and the others' outputs are unchanged."""
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story."}])
    other = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = _run(_engine(engine, overlap=False), [(other, greedy, 1)])[0]
    eng = _engine(engine, overlap=True)
    eng.start()
    try:
        seen, aborted = [], threading.Event()

        def emit(out):
            seen.append(out)
            if len(seen) == 5:
                eng.abort(out.request_id)
                aborted.set()

        eng.submit(prompt, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True), emit)
        result = eng.generate_sync(other, greedy)
        assert aborted.wait(30)
        for _ in range(200):  # the abort is taken between steps
            if seen[-1].finished:
                break
            threading.Event().wait(0.05)
    finally:
        eng.shutdown()
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for o in seen) < 500
    assert result.token_ids == expected.token_ids
    assert eng.blocks.num_free == eng.blocks.num_blocks


def _seq(i: int, tokens: int) -> Sequence:
    seq = Sequence(f"r{i}", list(range(tokens)), SamplingParams(max_tokens=50), detokenizer=None)
    seq.status = Status.RUNNING
    return seq


def test_continue_decode_only_when_schedule_would_do_the_same():
    blocks = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4), blocks, prefix_caching=False)
    a, b = _seq(0, 4), _seq(1, 7)
    for seq in (a, b):
        blocks.grow(seq.block_table, seq.num_tokens)
        seq.num_computed = seq.num_tokens
        seq.token_ids.append(-1)  # the placeholder of the step in flight
        sched.running.append(seq)
    free = blocks.num_free  # 3 pages used (1 + 2)
    assert sched.continue_decode([b, a]) is None, "another order than the running list"
    sched.waiting.append(_seq(2, 3))
    assert sched.continue_decode([a, b]) is None, "a request waits to be admitted"
    sched.waiting.clear()
    batch = sched.continue_decode([a, b])
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 1]
    assert blocks.num_free == free - 1  # a's 5th token needs a second page; b's 8th fits its second
    assert len(a.block_table) == 2 and len(b.block_table) == 2
    # no page left for the step after: None, and nothing changes
    for seq in (a, b):
        seq.num_computed += 1
        seq.token_ids.append(-1)
    blocks.grow(a.block_table, 16)  # a takes the last free pages
    tables = [list(a.block_table), list(b.block_table)]
    assert sched.continue_decode([a, b]) is None
    assert [a.block_table, b.block_table] == tables
