"""What a request asks of generation, and what the engine streams back."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class RequestOutput:
    """One streamed step of a request: the new text and tokens since the last step.

    ``finish_reason`` is set on the last output: ``"stop"`` (EOS, stop token or stop
    string), ``"length"`` (max_tokens or the context end) or ``"abort"``.
    Token counts are cumulative.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
