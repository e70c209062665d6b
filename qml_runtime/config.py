"""Typed configuration: the model's shape, and the engine's cache and batching limits."""

from __future__ import annotations

from dataclasses import dataclass

from qml_kernels.rope import RopeScaling


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer, read from GGUF metadata or an HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    context_length: int
    tie_word_embeddings: bool
    rotary_dim: int = 0  # 0: the whole head rotates
    rope_scaling: RopeScaling | None = None
    # GGUF Llama weights are permuted for interleaved-pair RoPE; HF weights use rotate-half
    rope_interleaved: bool = False
    # mixture of experts (0 experts: a dense model). Layers in moe_layers replace the dense FFN
    # (intermediate_size) with num_experts SwiGLU experts of moe_intermediate_size, of which each
    # token uses num_experts_per_tok, weighted by router probabilities (renormalised over the
    # chosen ones if norm_topk_prob).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim], got {self.rotary_dim}")
        if self.rms_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_eps and rope_theta must be positive")
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        if self.num_experts == 0:
            if self.moe_layers:
                raise ValueError("moe_layers is set but num_experts is 0")
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        layers = self.moe_layers
        if any(not 0 <= i < self.num_layers for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"moe_layers must be distinct layer indices below {self.num_layers}, got {layers}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: ``num_blocks`` pages of ``block_size`` tokens per layer."""

    block_size: int = 16
    num_blocks: int = 0  # 0: derive from kv_cache_bytes
    enable_prefix_caching: bool = True
    host_bytes: int = 0  # host-RAM tier budget (0: none)
    disk_dir: str | None = None  # disk tier directory (None: none); survives restarts
    disk_bytes: int = 0  # disk tier budget

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 0 or self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("num_blocks, host_bytes and disk_bytes must be >= 0")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ValueError("a disk tier needs a positive byte budget")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: tokens computed in one forward pass, and sequences running at once."""

    max_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # the budget when one request is all there is: chunking exists so a long prompt does not
    # stall others' decode; alone, a larger chunk is faster (fewer passes over the weights,
    # and a whole fresh prompt can take the cuDNN attention path). 0: max_batched_tokens.
    max_tokens_alone: int = 0

    def __post_init__(self):
        if self.max_batched_tokens <= 0 or self.max_num_seqs <= 0 or self.max_tokens_alone < 0:
            raise ValueError("max_batched_tokens and max_num_seqs must be positive, max_tokens_alone >= 0")

    def budget(self, num_requests: int) -> int:
        """Tokens one step may compute when ``num_requests`` requests are running or waiting."""
        if num_requests <= 1:
            return max(self.max_batched_tokens, self.max_tokens_alone)
        return self.max_batched_tokens
