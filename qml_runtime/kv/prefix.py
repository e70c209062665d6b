"""Content addresses of KV blocks: a chained hash over full blocks of tokens.

Block i of a sequence is named by H(parent = name of block i-1, its tokens, the model
fingerprint, the tenant salt). The chain makes a block's name depend on everything
before it, so equal names mean equal prefixes (up to a hash collision, which the
caller rules out by comparing the stored tokens). The tenant salt is in every link:
two tenants never produce the same name, whatever they send. SHA-256 is
deterministic across processes and restarts (Python's ``hash`` is not), which the
disk tier relies on, and costs about a microsecond per 16-token block.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Iterable

ROOT = bytes(32)  # the parent of a sequence's first block


def block_hash(parent: bytes, tokens: Iterable[int], fingerprint: bytes, salt: bytes) -> bytes:
    h = hashlib.sha256()
    # lengths first, so no concatenation of (salt, fingerprint) can be read two ways
    h.update(struct.pack("<II", len(fingerprint), len(salt)))
    h.update(fingerprint)
    h.update(salt)
    h.update(parent)
    h.update(array("I", tokens).tobytes())
    return h.digest()


def chain(tokens: list[int], block_size: int, fingerprint: bytes, salt: bytes, start: bytes = ROOT,
          first_block: int = 0) -> list[bytes]:
    """Names of the full blocks of ``tokens`` from ``first_block`` on, continuing from ``start``."""
    names, parent = [], start
    for i in range(first_block, len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], fingerprint, salt)
        names.append(parent)
    return names


def model_fingerprint(*parts: object) -> bytes:
    """A 32-byte identity of everything the KV bytes depend on (weights, layout, dtype, page size)."""
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode()
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()
