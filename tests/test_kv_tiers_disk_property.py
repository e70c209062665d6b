"""Kept blocks stay findable while the disk is behind (hypothesis state machine, CPU).

Requests end and keep their pages (``persist``) in a host tier of two rows (or none) over a disk whose writer
writes only when a rule lets it (a disk that is behind: the writer's queue is drained a few items at a time). In
any order of those and of restores, every block handed to the tiers is found in some tier (host RAM, a file, or the
writer's own copy before its file lands: ``DiskWriter.copy_of``), and a restore, from host RAM or as a disk load,
puts exactly that block's bytes into the page.
"""

from __future__ import annotations

import queue
import shutil
import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from qml_runtime.kv import disk_loads
from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.disk_store import DiskStore
from qml_runtime.kv.host_tier import HostTier
from qml_runtime.kv.prefix import as_packed
from qml_runtime.kv.tiers import KVTiers
from qml_runtime.presets import PRESETS
from tests.test_write_from_host import _stalled_writer, _working_writer

PAGES, HOST_SLOTS, BLOCK = 4, 2, 4


def _name(block: int) -> bytes:
    return (b"block-%d" % block).ljust(32, b".")  # (the disk store's names are 32 bytes)


def _tokens(block: int) -> bytes:
    return bytes(as_packed((block,) * BLOCK))


class DiskTiersMachine(RuleBasedStateMachine):
    HOST_SLOTS = HOST_SLOTS

    def __init__(self):
        super().__init__()
        self._reader, disk_loads.READER = disk_loads.READER, "threads"  # (no child process per example)
        self.dir = tempfile.mkdtemp(prefix="qml-tiers-")
        self.kv = KVCache(PRESETS["tiny-llama"].config, PAGES, BLOCK, "cpu", torch.float32)
        self.kv.data.zero_()
        disk = DiskStore(self.dir, b"f" * 32, budget_bytes=2**30)
        host = HostTier(self.kv.row_bytes, self.HOST_SLOTS * self.kv.row_bytes, pin=False) if self.HOST_SLOTS else None
        self.tiers = KVTiers(self.kv, host, disk)
        self.writer = _stalled_writer(self.tiers)
        self.kept: list[int] = []
        self.next_block = 1

    def _write(self, items: int | None) -> None:
        """The writer's next ``items`` queued items written here (None: all of them)."""
        done = 0
        while items is None or done < items:
            try:
                item = self.writer._queue.get_nowait()
            except queue.Empty:
                return
            try:
                if item[0] == "block":
                    self.writer._write_block(item[1])
                else:
                    self.writer._write_pages(*item[1:])
            finally:
                self.writer._queue.task_done()
            done += 1

    @rule(page=st.integers(0, PAGES - 1))
    def request_ends(self, page):
        block, self.next_block = self.next_block, self.next_block + 1
        self.kv.data[:, :, page] = float(block)
        self.tiers.persist([(page, _name(block), _tokens(block), None)])
        self.kept.append(block)

    @rule(items=st.integers(1, 3))
    def disk_catches_up(self, items):
        self._write(items)

    @rule(pick=st.integers(0, 10**6), page=st.integers(0, PAGES - 1))
    def restore(self, pick, page):
        if not self.kept:
            return
        block = self.kept[pick % len(self.kept)]
        name, tokens = _name(block), _tokens(block)
        self.kv.data[:, :, page] = -1.0  # (whatever the page held)
        where = self.tiers.locate_run([name], tokens)
        assert where, f"block {block} found in no tier"
        if where == ["host"]:
            assert self.tiers.restore_host([name], tokens, [page]) == 1
        else:
            load = self.tiers.start_load([("disk", name, tokens)], [page], 0, BLOCK)
            assert self.tiers.apply_load(load) == 1, f"block {block}: its disk load missed"
        self.kv.settle()
        got = self.kv.data[:, :, page]
        assert bool((got == float(block)).all()), f"page {page} restored for block {block} holds {got.unique()}"

    @invariant()
    def every_kept_block_is_somewhere(self):
        host, disk = self.tiers.host._lru if self.tiers.host is not None else {}, self.tiers.disk
        for block in self.kept:
            name = _name(block)
            assert name in host or disk.contains(name) or self.writer.copy_of(name, _tokens(block)) is not None, \
                f"block {block} left every tier"

    def teardown(self):
        try:
            self._write(None)
            _working_writer(self.tiers)
            self.tiers.close()
        finally:
            disk_loads.READER = self._reader
            shutil.rmtree(self.dir, ignore_errors=True)


class NoHostTierMachine(DiskTiersMachine):
    """The same with no host tier: kept pages are gathered for the writer (its rows, until written)."""

    HOST_SLOTS = 0


DiskTiersMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_kept_blocks_stay_findable_while_the_disk_is_behind = DiskTiersMachine.TestCase
NoHostTierMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_with_no_host_tier_too = NoHostTierMachine.TestCase
