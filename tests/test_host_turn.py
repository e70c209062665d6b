"""The host's per-turn work over a long history, in faster forms: the same answers as the plain ones.

(benchmarks/host_turn_cpu.py measures the time; these check the results.)
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from qml_kernels.attention import block_tables_tensor
from qml_runtime.engine import _packed_ids
from qml_runtime.kv.prefix import pack


@pytest.mark.parametrize("ids, ok", [
    ([], True),
    ([0, 1, 511], True),
    ([True, 3], True),  # bool is an int (as isinstance says)
    ([0, 512], False),  # the vocabulary's end
    ([-1, 3], False),
    ([2**32 + 1], False),  # past uint32: would wrap
    ([2**70], False),
    ([1, 2.0], False),
    ([1, "2"], False),
    ([1, None], False),
    ([np.int64(3)], False),  # not an int, as before
])
def test_prompt_ids_are_checked_as_one_id_at_a_time_would(ids, ok):
    assert ok == all(isinstance(t, int) and 0 <= t < 512 for t in ids)
    assert _packed_ids(ids, 512) == (pack(ids) if ok else None)


def test_block_tables_tensor_is_the_padded_tables():
    rng = random.Random(1)
    tables = [[rng.randrange(2**31) for _ in range(n)] for n in (1700, 3, 0, 1699)]
    width = max(map(len, tables))
    got = block_tables_tensor(tables)
    assert got.dtype == torch.int32
    assert torch.equal(got, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32))
    assert block_tables_tensor([[], []]).shape == (2, 0)
