"""Content addresses of KV blocks: a chained hash over full blocks of tokens.

Block i of a sequence is named by H(parent = name of block i-1, its tokens, the model
fingerprint, the tenant salt). The chain makes a block's name depend on everything
before it, so equal names mean equal prefixes (up to a hash collision, which the
caller rules out by comparing the stored tokens). The tenant salt is in every link:
two tenants never produce the same name, whatever they send. SHA-256 is
deterministic across processes and restarts (Python's ``hash`` is not), which the
disk tier relies on, and costs about a microsecond per 16-token block.

Tokens are compared as packed bytes (``pack``: uint32, the bytes the names hash), a whole run
of blocks in one comparison. And since the next turn of a conversation is the previous turn's
tokens and more, ``KnownChains`` hands it the names of the part it shares with a sequence named
before, matched on those bytes: a 27k-token history is then not hashed again every turn (1,700
blocks, ~1 ms of the host's time before the turn's first step can launch).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict
from typing import Iterable

import numpy as np

ROOT = bytes(32)  # the parent of a sequence's first block
TOKEN_BYTES = array("I").itemsize  # per token in ``pack``'s bytes


def pack(tokens: Iterable[int]) -> bytes:
    """Tokens as the bytes their block names hash: what stored tokens are compared by."""
    return array("I", tokens).tobytes()


def as_packed(tokens: bytes | bytearray | Iterable[int]) -> bytes | bytearray:
    """``tokens`` packed: bytes are taken as packed already, anything else as the token ids."""
    return tokens if isinstance(tokens, (bytes, bytearray)) else pack(tokens)


def unpack(data: bytes | bytearray) -> list[int]:
    """The token ids of ``pack``'s bytes (for the disk store, which takes ids)."""
    return array("I", data).tolist()


def block_hash(parent: bytes, tokens: Iterable[int], fingerprint: bytes, salt: bytes) -> bytes:
    h = hashlib.sha256()
    # lengths first, so no concatenation of (salt, fingerprint) can be read two ways
    h.update(struct.pack("<II", len(fingerprint), len(salt)))
    h.update(fingerprint)
    h.update(salt)
    h.update(parent)
    h.update(pack(tokens))
    return h.digest()


def _salted(fingerprint: bytes, salt: bytes):
    h = hashlib.sha256()
    h.update(struct.pack("<II", len(fingerprint), len(salt)))
    h.update(fingerprint)
    h.update(salt)
    return h


def chain(tokens: list[int], block_size: int, fingerprint: bytes, salt: bytes, start: bytes = ROOT,
          first_block: int = 0) -> list[bytes]:
    """Names of the full blocks of ``tokens`` from ``first_block`` on, continuing from ``start``.

    The same names as ``block_hash`` block by block, at a fifth of the cost (a 27k-token prompt:
    4.0 -> 0.8 ms here): the hash state after the constant prefix (lengths, fingerprint, salt)
    is copied, not rebuilt, and the tokens become bytes once, not once per block."""
    n = len(tokens) // block_size
    if n <= first_block:
        return []
    return chain_packed(pack(tokens[first_block * block_size:n * block_size]), block_size, fingerprint, salt, start)


def chain_packed(data: bytes, block_size: int, fingerprint: bytes, salt: bytes, start: bytes = ROOT) -> list[bytes]:
    """``chain`` over tokens already packed (``pack``): the names of the whole blocks of ``data``."""
    names, parent = [], start
    base = _salted(fingerprint, salt)
    step = block_size * TOKEN_BYTES
    for off in range(0, len(data) - step + 1, step):
        h = base.copy()
        h.update(parent)
        h.update(data[off:off + step])
        parent = h.digest()
        names.append(parent)
    return names


class KnownChains:
    """Block names of sequences named before, reused where a new sequence starts with the same tokens.

    A block's name depends only on the tokens up to its end, the fingerprint (one per cache, so
    one per instance of this) and the salt (part of the key). Where a new sequence's packed
    tokens equal a known sequence's from the start, byte for byte, so do the names of those
    blocks: they are copied, and only the rest is hashed. The match is made on the tokens
    themselves, never on a hash, so a name taken from here is the one ``chain`` gives.

    Entries are found by (salt, first block's tokens). Conversations that share a system prompt
    share that key, so the ``per_key`` most recent entries are kept under it; an entry whose
    tokens begin a newer one's (the previous turn of the same conversation) is replaced by it.
    Past ``max_blocks`` blocks (~170 bytes each: 64 of tokens, a 32-byte name) the least
    recently used keys go.
    """

    def __init__(self, block_size: int, max_blocks: int, per_key: int = 8):
        self.block_bytes = block_size * TOKEN_BYTES
        self.max_blocks, self.per_key = max_blocks, per_key
        self._entries: OrderedDict[tuple[bytes, bytes], list[tuple[bytes, list[bytes]]]] = OrderedDict()
        self.num_blocks = 0

    def add(self, salt: bytes, data: bytes, names: list[bytes]) -> None:
        """Remember ``names``: the chain of ``data``, packed tokens of whole blocks, under ``salt``."""
        B = self.block_bytes
        if len(data) != len(names) * B:
            raise ValueError(f"{len(names)} names for {len(data)} bytes of tokens")
        if not names:
            return
        key = (salt, data[:B])
        bucket = self._entries.pop(key, [])
        if any(known.startswith(data) for known, _ in bucket):
            self._entries[key] = bucket  # nothing new: only its recency changes
            return
        # the newest first; the few most recent of the rest, less those it extends
        kept = [(data, names)] + [e for e in bucket if not data.startswith(e[0])][:self.per_key - 1]
        self.num_blocks += sum(len(n) for _, n in kept) - sum(len(n) for _, n in bucket)
        self._entries[key] = kept
        while self.num_blocks > self.max_blocks and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self.num_blocks -= sum(len(n) for _, n in dropped)

    def names(self, salt: bytes, data: bytes) -> list[bytes]:
        """Names of the longest run of whole blocks at the start of ``data`` (packed tokens) that a
        known sequence shares."""
        B = self.block_bytes
        key = (salt, data[:B])
        bucket = self._entries.get(key) if len(data) >= B else None
        if not bucket:
            return []
        self._entries.move_to_end(key)
        whole = len(data) // B
        best: list[bytes] = []
        for known, names in bucket:
            # the usual case: a known turn is where this one starts (one memcmp)
            n = len(names) if data.startswith(known) else _common_blocks(known, data, B)
            if n > len(best):
                best = names[:min(n, whole)]
        return best


def _common_blocks(a: bytes, b: bytes, block: int) -> int:
    """How many whole blocks of ``block`` bytes ``a`` and ``b`` share from the start."""
    n = min(len(a), len(b)) // block * block
    x = np.frombuffer(a, np.uint8, n)
    y = np.frombuffer(b, np.uint8, n)
    differ = np.flatnonzero(x != y)
    return (int(differ[0]) if len(differ) else n) // block


def model_fingerprint(*parts: object) -> bytes:
    """A 32-byte identity of everything the KV bytes depend on (weights, layout, dtype, page size)."""
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode()
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()
