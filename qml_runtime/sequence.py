"""The state of one request inside the engine."""

from __future__ import annotations

import enum
import itertools
import threading
import time
from array import array

from qml_runtime.constrained import GrammarMatcher
from qml_runtime.detokenizer import IncrementalDetokenizer
from qml_runtime.kv.prefix import TOKEN_BYTES
from qml_runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class TokenIds:
    """A sequence's token ids, as a list reads them: the prompt kept in the form it came in, the ids after it
    (sampled, and the engine's placeholders) in a list. A prompt that comes as a uint32 ``array`` (the server's
    chat prompts and token-id prompts) stays one: making a 27k-token conversation's ids Python ints took
    ~0.35 ms of the request's path on CPU every turn, and the engine reads only a turn's new ids (slices, made
    lists as they are read), the length, and the ids it samples after them."""

    __slots__ = ("_prompt", "_rest")

    def __init__(self, prompt: list[int] | array):
        # (copied: the caller may reuse its list; an array copies as one block)
        self._prompt = prompt[:] if isinstance(prompt, array) else list(prompt)
        self._rest: list[int] = []

    def __len__(self) -> int:
        return len(self._prompt) + len(self._rest)

    def _index(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError("token index out of range")
        return i + n if i < 0 else i

    def __getitem__(self, i):
        P = len(self._prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return list(self)[i]
            stop = max(start, stop)
            head = self._prompt[start:min(stop, P)] if start < P else []
            head = head.tolist() if isinstance(head, array) else head
            return head + self._rest[max(start - P, 0):max(stop - P, 0)] if stop > P else head
        i = self._index(i)
        return self._prompt[i] if i < P else self._rest[i - P]

    def __setitem__(self, i: int, token: int) -> None:
        """An id after the prompt (the engine fills in a placeholder so)."""
        i = self._index(i) - len(self._prompt)
        if i < 0:
            raise IndexError("a prompt's token ids do not change")
        self._rest[i] = token

    def append(self, token: int) -> None:
        self._rest.append(token)

    def pop(self) -> int:
        """The last id after the prompt (the engine takes back a placeholder so)."""
        if not self._rest:
            raise IndexError("a prompt's token ids do not change")
        return self._rest.pop()

    def __iter__(self):
        return itertools.chain(self._prompt, self._rest)

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, TokenIds)) and len(self) == len(other) and list(self) == list(other)

    __hash__ = None

    def __add__(self, other: list[int]) -> list[int]:
        return list(self) + list(other)

    def __radd__(self, other: list[int]) -> list[int]:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"


class Sequence:
    """Tokens (prompt then generated), how many of them have KV in the cache, and the pages holding it."""

    def __init__(self, request_id: str, prompt_ids: list[int] | array, params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, seed: int = 0, salt: bytes = b"", retain: bool = False,
                 grammar: GrammarMatcher | None = None, packed_prompt: bytes | None = None):
        self.request_id = request_id
        self.params = params
        self.token_ids = TokenIds(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        # the prompt packed (kv.prefix.pack) where the caller has it already: its blocks are named from it
        if packed_prompt is not None and len(packed_prompt) != self.num_prompt_tokens * TOKEN_BYTES:
            raise ValueError(f"packed_prompt holds {len(packed_prompt)} bytes for {self.num_prompt_tokens} tokens")
        self.packed_prompt = packed_prompt
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.num_cached = 0  # prompt tokens found in the prefix cache at first admission, not computed
        self.salt = salt  # the tenant's: enters every page name, so tenants never share pages
        self.retain = retain  # a named session: its pages are the last to be evicted
        self.block_names: list[bytes] = []  # content names of the sequence's full blocks, computed in order
        self.named_tokens = bytearray()  # the tokens those names hash, packed (kv.prefix.pack)
        self.num_committed = 0  # pages of block_table registered under their names
        self.admitted = False
        self.announce = False  # an empty output once its first step is on the device (Engine.submit's announce)
        self.started: threading.Event | None = None  # set once that step is launched (engine_requests.HANDOFF_S)
        self.block_table: list[int] = []
        self.pending_load = None  # kv.disk_loads.PendingLoad: blocks streaming into its pages
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        self.logits_slot: int | None = None  # its row of the LogitsProcessor's token counts (penalties)
        self.grammar = grammar  # its parse of params.grammar, advanced by each sampled token
        # sampled outside the CUDA graphs (qml_runtime.runner): computed once, read every step
        self.custom_sampling = params.processes_logits or params.logprobs is not None
        self.seed = seed  # with the step (num_output_tokens), keys this request's random stream in the sampler
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None  # set by the engine at the first step that runs it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, pages={len(self.block_table)})")
