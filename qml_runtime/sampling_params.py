"""What a request asks of generation, and what the engine streams back."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's chat API allows
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias


class InvalidParameter(ValueError):
    """A request parameter is out of range. ``param`` names it, as OpenAI errors do."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping for one request.

    ``temperature == 0`` is greedy. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0``
    switch those filters off. ``seed`` makes sampling reproducible per request.

    Logits processing (qml_runtime.logits), applied before temperature and the filters:
    ``logit_bias`` adds a bias in [-100, 100] to token ids; ``min_tokens`` masks EOS and
    ``stop_token_ids`` until that many tokens are out; ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI: subtract ``presence * [count > 0] + frequency * count``,
    counting generated tokens) and ``repetition_penalty`` (HF/vLLM: divide positive logits,
    multiply negative ones, for tokens of the prompt or the output). ``logprobs = k``
    returns, for each generated token, its log-probability and the k most likely
    alternatives; None returns none.

    ``grammar`` (llguidance's serialized grammar, from qml_runtime.constrained) limits the output
    to the strings it allows: disallowed tokens are masked before sampling, and generation stops
    when the grammar is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); ids checked against the vocabulary
    min_tokens: int = 0
    logprobs: int | None = None
    grammar: str | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidParameter("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidParameter("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParameter("top_k", f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameter("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidParameter("seed", f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParameter("stop", "stop sequences must be non-empty strings")
        if len(self.stop) > 16:
            raise InvalidParameter("stop", f"at most 16 stop sequences are allowed, got {len(self.stop)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidParameter(name, f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0):
            raise InvalidParameter("repetition_penalty",
                                   f"repetition_penalty must be in (0, 10] (1 is off), got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParameter("logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, "
                                   f"got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise InvalidParameter("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} "
                                       f"for token {token}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidParameter("min_tokens", f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens "
                                   f"({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidParameter("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                                   f"got {self.logprobs!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise InvalidParameter("grammar", "grammar must be a non-empty string (a compiled llguidance grammar)")

    @property
    def processes_logits(self) -> bool:
        """Whether the logits need work beyond temperature and the filters (the in-graph sampler's)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.grammar is not None)

    @property
    def penalized(self) -> bool:
        """Whether the sampler needs this request's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of an ``n > 1`` request: its own random stream.

        Choice 0 keeps the request's seed (so ``n = 1`` samples as before); choice i > 0 gets a
        seed hashed from (seed, i), reproducible and unrelated to its neighbours'. Without a
        seed every choice draws its own random seed in the engine anyway.
        """
        if index == 0 or self.seed is None:
            return self
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=8).digest()
        return replace(self, seed=int.from_bytes(digest, "little") >> 1)  # [0, 2^63): an int64 on the wire


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives at its position.

    Log-probabilities are the log-softmax of the model's raw logits (see qml_runtime.logits).
    ``top`` holds (token id, logprob) pairs, most likely first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One streamed step of a request: the new text and tokens since the last step.

    ``finish_reason`` is set on the last output: ``"stop"`` (EOS, stop token or stop
    string), ``"length"`` (max_tokens or the context end) or ``"abort"``.
    Token counts are cumulative. ``logprobs`` (when the request asked for them) has one
    entry per token of ``token_ids``, except a token that ended generation as a stop token
    (EOS or ``stop_token_ids``), which, like its text, is left out.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
