"""Scheduling policy on its own: chunked prefill, token budget, admission order, preemption."""

from __future__ import annotations

from qml_runtime.config import SchedulerConfig
from qml_runtime.kv.block_manager import BlockManager
from qml_runtime.sampling_params import SamplingParams
from qml_runtime.scheduler import Scheduler
from qml_runtime.sequence import Sequence, Status


def seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, list(range(prompt_len)), SamplingParams(max_tokens=64), detokenizer=None)


def run_step(batch):
    """What the runner does to the sequences: compute, then sample one token where due."""
    for s, n in zip(batch.seqs, batch.num_tokens):
        s.num_computed += n
        if s.num_computed == s.num_tokens:
            s.token_ids.append(0)


def test_long_prompt_is_chunked_and_decode_keeps_going():
    sched = Scheduler(SchedulerConfig(max_batched_tokens=64, max_num_seqs=8), BlockManager(64, 16))
    short = seq("short", 10)
    sched.add(short)
    run_step(sched.schedule())  # short prefilled, first token sampled
    long = seq("long", 200)
    sched.add(long)
    for _ in range(4):
        batch = sched.schedule()
        assert batch.seqs[0] is short and batch.num_tokens[0] == 1  # decode is never stalled
        assert sum(batch.num_tokens) <= 64
        run_step(batch)
    # 4 steps x 63 tokens cover the 200-token prompt
    assert long.num_computed == 200 and long.num_tokens == 201


def test_admission_is_in_arrival_order_and_bounded_by_max_num_seqs():
    sched = Scheduler(SchedulerConfig(max_batched_tokens=1000, max_num_seqs=2), BlockManager(64, 16))
    a, b, c = seq("a", 5), seq("b", 5), seq("c", 5)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [a, b]
    assert c.status is Status.WAITING


def test_preemption_frees_pages_and_requeues_at_the_front():
    blocks = BlockManager(4, 16)  # 64 tokens of KV in all
    sched = Scheduler(SchedulerConfig(max_batched_tokens=1000, max_num_seqs=8), blocks)
    a, b = seq("a", 32), seq("b", 31)
    sched.add(a)
    sched.add(b)
    run_step(sched.schedule())  # a: 2 pages, b: 2 pages, pool full; both now 1 token past a page edge or at it
    assert blocks.num_free == 0
    batch = sched.schedule()  # a needs a third page for token 33: b (admitted last) is preempted
    assert batch.seqs == [a]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.block_table == []
    assert sched.waiting[0] is b
    run_step(batch)
    sched.finish(a, "stop")
    assert blocks.num_free == 4
    batch = sched.schedule()  # b is recomputed from its tokens, including the one it had generated
    assert batch.seqs == [b] and batch.num_tokens == [32]


def test_finish_releases_pages_of_waiting_and_running():
    blocks = BlockManager(8, 16)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=16, max_num_seqs=8), blocks)
    a, b = seq("a", 40), seq("b", 8)
    sched.add(a)
    sched.add(b)
    sched.schedule()  # a admitted with a 16-token chunk, b waits (budget spent)
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert blocks.num_free == 8 and not sched.has_work()


def test_a_lone_request_gets_the_larger_budget_until_another_arrives():
    config = SchedulerConfig(max_batched_tokens=64, max_num_seqs=8, max_tokens_alone=256)
    assert config.budget(0) == config.budget(1) == 256 and config.budget(2) == 64
    sched = Scheduler(config, BlockManager(64, 16))
    long = seq("long", 400)
    sched.add(long)
    batch = sched.schedule()
    assert batch.num_tokens == [256]  # alone: one big chunk
    run_step(batch)
    other = seq("other", 10)
    sched.add(other)
    batch = sched.schedule()
    assert sum(batch.num_tokens) <= 64 and batch.seqs[0] is long  # company: back to the shared budget
    run_step(batch)
    assert long.num_computed == 256 + 64 and other.num_computed == 0


def test_max_tokens_alone_zero_means_the_shared_budget():
    assert SchedulerConfig(max_batched_tokens=64).budget(1) == 64


def test_decode_rows_do_not_cut_a_prompt_that_fits_the_budget_into_two_steps():
    """32 conversations of 2,048-token prompts under a 2,048-token budget: once some decode, each
    later prompt must still be prefilled in one step, not 2,048 - k then k."""
    sched = Scheduler(SchedulerConfig(max_batched_tokens=64, max_num_seqs=8), BlockManager(64, 16))
    a, b = seq("a", 64), seq("b", 64)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a] and batch.num_tokens == [64]
    run_step(batch)  # a decodes from now on
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 64]  # 65 tokens: one over, for a's row
    run_step(batch)
    # longer than the budget plus the decode rows: chunked at the budget as before
    c = seq("c", 100)
    sched.add(c)
    batch = sched.schedule()
    assert batch.seqs == [a, b, c] and batch.num_tokens == [1, 1, 62]
    run_step(batch)
    batch = sched.schedule()
    assert batch.num_tokens == [1, 1, 38]


def test_a_sequence_leaving_with_blocks_still_loading_hands_its_load_to_the_tiers_first():
    """Its pages may receive a copy still in flight (a split's tail): the tiers order whoever takes them next
    after it (``KVTiers.drop_load``) before the pages are released."""
    events = []

    class Tiers:
        def locate_run(self, names, packed):
            return []  # nothing below the GPU

        def drop_load(self, load):
            events.append(("drop", load, blocks.num_free))

    blocks = BlockManager(4, 16)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=1000, max_num_seqs=8), blocks, tiers=Tiers())
    a, b = seq("a", 32), seq("b", 31)
    sched.add(a)
    sched.add(b)
    run_step(sched.schedule())
    b.pending_load = "b's load"
    sched.schedule()  # a needs a page: b is preempted
    assert events == [("drop", "b's load", 0)] and b.pending_load is None  # handed over before its pages were freed
    a.pending_load = "a's load"
    free = blocks.num_free
    sched.finish(a, "abort")
    assert events[-1] == ("drop", "a's load", free) and a.pending_load is None and blocks.num_free > free
