"""Where kernels run: the GPU when there is one, else the CPU with Triton's interpreter."""

from __future__ import annotations

import os
import sys


def setup_device() -> str:
    """Pick the device; without a GPU, turn Triton's interpreter on. Returns "cuda" or "cpu".

    Must run before Triton is imported: Triton decorates its own library functions
    at import, in whichever mode is set then.
    """
    import torch

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said so it stops warning
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        if "triton" in sys.modules:
            raise RuntimeError("call setup_device() before anything imports triton (qml_kernels ops, the "
                               "workbench): without a GPU Triton must start in interpreter mode")
        os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"
