"""Hugging Face model folders: config.json plus safetensors shards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open


class HFFolder:
    """A folder with ``config.json`` and ``*.safetensors`` (one file, or shards with an index)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{self.path}: no config.json (not a Hugging Face model folder)")
        self.config: dict = json.loads(config_path.read_text())
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors weights")
        self._where: dict[str, Path] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    self._where[name] = file

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or [""]
        return archs[0]

    def names(self) -> list[str]:
        return list(self._where)

    def dtype_name(self, name: str) -> str:
        with safe_open(self._where[name], framework="pt") as f:
            return f.get_slice(name).get_dtype()

    def load(self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
        with safe_open(self._where[name], framework="pt") as f:
            return f.get_tensor(name).to(device=device, dtype=dtype)
