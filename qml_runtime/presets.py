"""Model presets: real architectures at their real shapes, with random weights, for benchmarks.

``qml serve --model preset:llama-3.1-8b --random-weights`` serves Llama-3.1-8B's exact shapes
(and so its exact FLOPs, bytes and KV footprint) without its weights file: what a speed
benchmark needs, on machines that cannot fetch 16 GB of checkpoint. The output is noise.

Weights are drawn on the target device itself (no 16 GB pass through host memory) from a
fixed seed: normal(0, 1/sqrt(fan_in)) for every matrix, ones for every norm. With inputs of
unit RMS (what RMSNorm hands each projection) every projection's output then has unit RMS
too, attention scores have unit variance after the 1/sqrt(Dh) scale, and the residual stream
grows only as sqrt(layers), so activations stay finite in bf16 through all layers.

A preset has no tokenizer file either: ``ByteTokenizer`` stands in, one token per UTF-8 byte,
so a prompt's token count is its byte count plus the plain chat rendering's few bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from qml_kernels.rope import RopeScaling
from qml_runtime import models
from qml_runtime.config import ModelConfig, SchedulerConfig
from qml_runtime.engine import Engine
from qml_runtime.kv.prefix import model_fingerprint

__all__ = ["PRESETS", "PRESET_PREFIX", "ByteTokenizer", "Preset", "UnknownPreset", "is_preset",
           "load_preset_engine", "randomize_weights"]

log = logging.getLogger("qml.loader")

PRESET_PREFIX = "preset:"
RANDOM_SEED = 0


class UnknownPreset(ValueError):
    pass


@dataclass(frozen=True)
class Preset:
    """A model shape: its config and the HF architecture name whose model code runs it."""

    config: ModelConfig
    hf_architecture: str
    description: str


PRESETS: dict[str, Preset] = {
    "llama-3.1-8b": Preset(
        ModelConfig(
            architecture="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position=8192,
                                     low_freq_factor=1.0, high_freq_factor=4.0),
            context_length=131072,
            tie_word_embeddings=False,
        ),
        "LlamaForCausalLM",
        "Meta Llama-3.1-8B (8.0B parameters, GQA 32/8, 128K context)",
    ),
    # Small enough for CPU tests; the same code paths as the 8B (GQA, llama3 RoPE, untied head).
    "tiny-llama": Preset(
        ModelConfig(
            architecture="llama",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=160,
            num_layers=3,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rms_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position=512,
                                     low_freq_factor=1.0, high_freq_factor=4.0),
            context_length=4096,
            tie_word_embeddings=False,
        ),
        "LlamaForCausalLM",
        "a 3-layer Llama for tests",
    ),
    "qwen3-30b-a3b": Preset(
        ModelConfig(
            architecture="qwen3_moe",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,  # the dense FFN width, unused: every layer has experts
            num_layers=48,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            rms_eps=1e-6,
            rope_theta=1000000.0,
            context_length=40960,
            tie_word_embeddings=False,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            moe_layers=tuple(range(48)),
        ),
        "Qwen3MoeForCausalLM",
        "Qwen Qwen3-30B-A3B (30.5B parameters, 3.3B active: 8 of 128 experts; GQA 32/4, 40K context)",
    ),
    # Small enough for CPU tests; the code paths of the 30B-A3B (q/k norms, experts, top-k routing).
    "tiny-qwen3-moe": Preset(
        ModelConfig(
            architecture="qwen3_moe",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            num_layers=3,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            rms_eps=1e-6,
            rope_theta=1000000.0,
            context_length=4096,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            moe_layers=(0, 1, 2),
        ),
        "Qwen3MoeForCausalLM",
        "a 3-layer Qwen3-MoE (8 experts, top-2) for tests",
    ),
    "qwen3-32b": Preset(
        ModelConfig(
            architecture="qwen3",
            vocab_size=151936,
            hidden_size=5120,
            intermediate_size=25600,
            num_layers=64,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            rms_eps=1e-6,
            rope_theta=1000000.0,
            context_length=40960,
            tie_word_embeddings=False,
        ),
        "Qwen3ForCausalLM",
        "Qwen Qwen3-32B (32.8B parameters, GQA 64/8, 40K context)",
    ),
}


def is_preset(model: str | None) -> bool:
    return isinstance(model, str) and model.startswith(PRESET_PREFIX)


def get_preset(model: str) -> tuple[str, Preset]:
    name = model.removeprefix(PRESET_PREFIX)
    if name not in PRESETS:
        raise UnknownPreset(f"unknown preset {name!r} (presets: {', '.join(sorted(PRESETS))})")
    return name, PRESETS[name]


# --- weights --------------------------------------------------------------------------------

@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int = RANDOM_SEED) -> None:
    """Fill every parameter in place, on its own device: norms (1-D) with ones, matrices (and
    stacked expert matrices) with normal(0, 1/sqrt(fan_in)), fan_in being the last dimension.

    The embedding table is looked up rather than multiplied, so it gets unit-RMS rows like the
    activations it stands for; tied to the output head it is a matrix over D and is scaled as one.
    Same seed, device type and dtype: same weights.
    """
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    tied = getattr(model, "lm_head", object()) is None
    for name, p in params.items():
        if p.dim() == 1:
            p.fill_(1.0)
        elif name == "embed" and not tied:
            p.normal_(0.0, 1.0, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


def random_model(preset: Preset, device: torch.device, dtype: torch.dtype,
                 seed: int = RANDOM_SEED) -> torch.nn.Module:
    """The preset's model with random weights, allocated and filled on ``device``."""
    net = models.for_hf(preset.hf_architecture).model_cls(preset.config, device, dtype)
    randomize_weights(net, seed)
    return net


# --- tokenizer ------------------------------------------------------------------------------

class ByteTokenizer:
    """A deterministic stand-in tokenizer: ids 0-255 are the UTF-8 bytes of the text, 256 is BOS.

    The other ids of the model's vocabulary are never produced by ``encode``; a random model
    generates them all the time, so each decodes to one printable character (one visible
    streamed delta per generated token). There is no EOS (``eos_token_ids`` is empty): generation
    always runs to ``max_tokens``, as a benchmark wants. Same interface as ``Tokenizer`` for what
    the engine and the server call.
    """

    NUM_BYTES = 256
    _FILLER = "abcdefghijklmnopqrstuvwxyz "

    def __init__(self, vocab_size: int):
        if vocab_size < self.NUM_BYTES + 1:
            raise ValueError(f"ByteTokenizer needs a vocabulary of at least 257 ids, got {vocab_size}")
        self._vocab_size = vocab_size
        self.bos_token_id: int | None = self.NUM_BYTES
        self.eos_token_id: int | None = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.add_bos = True

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token(self) -> str:
        return "<bos>"

    @property
    def eos_token(self) -> None:
        return None

    def token_to_id(self, token: str) -> int | None:
        if token == self.bos_token:
            return self.bos_token_id
        data = token.encode("utf-8")
        return data[0] if len(data) == 1 else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.NUM_BYTES, *ids] if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        parts: list[str] = []
        pending = bytearray()  # a run of byte ids, decoded together so multi-byte characters survive
        for i in map(int, ids):
            if 0 <= i < self.NUM_BYTES:
                pending.append(i)
                continue
            if pending:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if i == self.bos_token_id:
                parts.append("" if skip_special_tokens else self.bos_token)
            else:
                parts.append(self._FILLER[i % len(self._FILLER)])
        if pending:
            parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """A plain rendering, one ``role: content`` line per message; ``extra`` (template options
        such as enable_thinking) has nothing to act on and is ignored."""
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def encode_chat(self, text: str, continuation: bool = False) -> list[int]:
        """Ids of a rendered conversation: BOS, then the bytes; a ``continuation`` (the text after a
        reply whose ids are kept) is the bytes alone."""
        return self.encode(text, add_special_tokens=not continuation)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        return self.encode_chat(self.render_chat(messages, add_generation_prompt, **extra))

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


# --- the engine -----------------------------------------------------------------------------

def load_preset_engine(model: str | None, random_weights: bool, *, device: str = "auto",
                       max_model_len: int | None = None, served_model_name: str | None = None,
                       dtype: str = "auto", kv_cache_gib: float | None = None, block_size: int = 16,
                       max_batched_tokens: int = 2048, max_num_seqs: int = 64,
                       enable_prefix_caching: bool = True, kv_host_gib: float | None = None,
                       kv_disk_dir: str | None = None, kv_disk_gib: float | None = None,
                       max_tokens_alone: int = 0, cuda_graphs: bool = True) -> Engine:
    """``load_engine`` for ``preset:<name>``: the preset's model with random weights, on ``device``."""
    from qml_runtime.loader import _kv_blocks, cache_config, resolve_device, resolve_dtype  # (import cycle)

    if not is_preset(model):
        raise ValueError(f"--random-weights applies to --model preset:<name> only (presets: "
                         f"{', '.join(sorted(PRESETS))}); a model file brings its own weights")
    name, preset = get_preset(model)
    if not random_weights:
        raise ValueError(f"{model} is a shape without weights; add --random-weights (random_weights=True) "
                         f"to serve it with random weights, for speed measurements (its output is noise)")
    cfg = preset.config
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    t0 = time.perf_counter()
    net = random_model(preset, dev, torch_dtype)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # for an honest load time
    n_params = sum(p.numel() for p in net.parameters())
    blocks = _kv_blocks(cfg, block_size, torch_dtype, dev, kv_cache_gib)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    info = {
        "model_path": model,
        "architecture": cfg.architecture,
        "parameters": n_params,
        "quant_types": {f"random-{dtype_name}": sum(1 for _ in net.parameters())},
        "device": str(dev),
        "dtype": dtype_name,
        "weights": f"random normal(0, 1/sqrt(fan_in)), seed {RANDOM_SEED}",
    }
    # the generators of CPU and CUDA draw different numbers from the same seed
    identity = f"{model}:random:{RANDOM_SEED}:{dev.type}".encode()
    fingerprint = model_fingerprint(identity, cfg, str(torch_dtype), block_size)
    engine = Engine(net, ByteTokenizer(cfg.vocab_size), cfg, model_id=served_model_name or f"{name}-random",
                    device=dev, dtype=torch_dtype,
                    cache=cache_config(block_size, blocks, enable_prefix_caching, dev, kv_host_gib, kv_disk_dir,
                                       kv_disk_gib),
                    scheduler=SchedulerConfig(max_batched_tokens=max_batched_tokens, max_num_seqs=max_num_seqs,
                                              max_tokens_alone=max_tokens_alone),
                    context_length=max_model_len, info=info, fingerprint=fingerprint, cuda_graphs=cuda_graphs)
    log.warning("%s has RANDOM weights (seed %d) and a byte-level stand-in tokenizer: its output is noise; "
                "use it to measure speed", model, RANDOM_SEED)
    log.info("built %s (%s) in %.1f s: architecture=%s parameters=%.1fM weights=random context=%d device=%s "
             "dtype=%s kv_cache=%d tokens (%.2f GiB)", model, preset.description, time.perf_counter() - t0,
             cfg.architecture, n_params / 1e6, engine.context_length, dev, dtype_name, blocks * block_size,
             engine.kv.nbytes / 2**30)
    return engine
