"""Model registry: GGUF ``general.architecture`` and HF ``architectures`` names to model code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qml_runtime.config import ModelConfig
from qml_runtime.models import llama, qwen3


@dataclass(frozen=True)
class Architecture:
    model_cls: type
    config_from_gguf: Callable[[dict, set[str]], ModelConfig]
    config_from_hf: Callable[[dict], ModelConfig]
    gguf_weights: dict[str, tuple[str, str | None]]
    hf_weights: dict[str, tuple[str, str | None]]


LLAMA = Architecture(llama.LlamaModel, llama.config_from_gguf, llama.config_from_hf,
                     llama.GGUF_WEIGHTS, llama.HF_WEIGHTS)

# one model class for Qwen3 and Qwen3-MoE: the config says which layers have experts
QWEN3 = Architecture(qwen3.Qwen3Model, qwen3.config_from_gguf, qwen3.config_from_hf,
                     qwen3.GGUF_WEIGHTS, qwen3.HF_WEIGHTS)

GGUF_ARCHITECTURES: dict[str, Architecture] = {"llama": LLAMA, "qwen3": QWEN3, "qwen3moe": QWEN3}
HF_ARCHITECTURES: dict[str, Architecture] = {"LlamaForCausalLM": LLAMA, "MistralForCausalLM": LLAMA,
                                             "Qwen3ForCausalLM": QWEN3, "Qwen3MoeForCausalLM": QWEN3}


class UnsupportedArchitecture(ValueError):
    pass


def for_gguf(name: str) -> Architecture:
    if name not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(f"GGUF architecture {name!r} is not supported "
                                      f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")
    return GGUF_ARCHITECTURES[name]


def for_hf(name: str) -> Architecture:
    if not name:
        raise UnsupportedArchitecture("config.json does not name the model class ('architectures' is missing)")
    if name not in HF_ARCHITECTURES:
        raise UnsupportedArchitecture(f"Hugging Face architecture {name!r} is not supported "
                                      f"(supported: {', '.join(sorted(HF_ARCHITECTURES))})")
    return HF_ARCHITECTURES[name]
