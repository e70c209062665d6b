"""SpillQueue (qml_runtime.kv.spill_queue): the pairs waiting for their copy down, and the slot
questions KVTiers asks of them, against a plain list under any sequence of changes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qml_runtime.kv.spill_queue import SpillQueue

pairs = st.tuples(st.integers(0, 40), st.integers(0, 12))
ops = st.lists(st.one_of(
    st.tuples(st.just("append"), pairs),
    st.tuples(st.just("extend"), st.lists(pairs, max_size=5)),
    st.tuples(st.just("drain"), st.none()),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops, st.sets(st.integers(0, 12), max_size=6))
def test_answers_as_a_list_would(sequence, probe):
    queue, model = SpillQueue(), []
    for op, arg in sequence:
        if op == "append":
            queue.append(*arg)
            model.append(arg)
        elif op == "extend":
            queue.extend(arg)
            model.extend(arg)
        else:
            got = queue.drain_by_slot()
            assert got == sorted(model, key=lambda pair: pair[1])  # stable: equal slots keep their order
            model = []
        assert list(queue) == model and len(queue) == len(model) and bool(queue) == bool(model)
        for slot in range(13):
            assert queue.has_slot(slot) == any(s == slot for _, s in model)
        assert queue.any_slot_in(probe) == any(s in probe for _, s in model)


def test_a_slot_queued_twice_stays_queued_until_drained():
    queue = SpillQueue()
    queue.append(3, 7)
    queue.append(9, 7)  # the slot changed hands and its new page was spilled too
    assert queue.has_slot(7)
    assert queue.drain_by_slot() == [(3, 7), (9, 7)]
    assert not queue.has_slot(7) and not queue and not queue.any_slot_in({3, 7, 9})
