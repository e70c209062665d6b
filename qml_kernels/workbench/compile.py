"""Compile Triton kernels for Hopper (sm_90a) on a machine without a GPU.

The interpreter accepts code the compiler rejects (and never allocates registers),
so every kernel is also compiled for the H200's architecture. The report gives
what decides occupancy and speed: registers per thread and spills (from ptxas),
shared memory, and whether Hopper's wgmma and TMA instructions were emitted where
they were intended.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class CompileReport:
    kernel: str
    ok: bool
    error: str | None = None
    registers: int | None = None
    spills: int | None = None  # bytes of thread-local memory (register spills and stack)
    shared_bytes: int = 0
    has_wgmma: bool = False
    has_tma: bool = False
    ptx: str = field(default="", repr=False)

    def summary(self) -> str:
        if not self.ok:
            return f"{self.kernel}: FAILED: {self.error}"
        return (f"{self.kernel}: {self.registers} registers, {self.spills} spill bytes, "
                f"{self.shared_bytes} B shared, wgmma={'yes' if self.has_wgmma else 'no'}, "
                f"tma={'yes' if self.has_tma else 'no'}")


def _jit_function(kernel) -> JITFunction:
    # under TRITON_INTERPRET=1 @triton.jit yields an interpreter wrapper; compile the function it wraps
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """Registers per thread and local (spill/stack) bytes, read from the cubin with the
    cuobjdump Triton ships (its ptxas may be older than the PTX version Triton emits)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        run = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True)
    regs, local = re.search(r"REG:(\d+)", run.stdout), re.search(r"LOCAL:(\d+)", run.stdout)
    return (int(regs.group(1)) if regs else None, int(local.group(1)) if local else None)


def compile_check(kernel, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4,
                  num_stages: int = 3, arch: int = 90) -> CompileReport:
    """Compile ``kernel`` for sm_{arch}a with the given argument types and constexpr values.

    ``signature`` maps every argument name to Triton's type string ("*bf16", "i32",
    "fp32", "constexpr", ...); ``constexprs`` gives the constexpr values.
    """
    fn = _jit_function(kernel)
    name = fn.fn.__name__ if hasattr(fn, "fn") else str(kernel)
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as exc:  # the report carries the compiler's message
        return CompileReport(name, ok=False, error=f"{type(exc).__name__}: {exc}")
    ptx = compiled.asm["ptx"]
    registers, spills = _resource_usage(compiled.asm["cubin"])
    return CompileReport(
        kernel=name,
        ok=True,
        registers=registers,
        spills=spills,
        shared_bytes=int(getattr(compiled.metadata, "shared", 0)),
        has_wgmma="wgmma.mma_async" in ptx,
        has_tma="cp.async.bulk.tensor" in ptx,
        ptx=ptx,
    )
