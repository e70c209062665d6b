"""Compile Triton kernels for Hopper (sm_90a) on a machine without a GPU.

The interpreter accepts code the compiler rejects (and never allocates registers),
so every kernel is also compiled for the H200's architecture. The report gives
what decides occupancy and speed: registers per thread and local-memory spills,
shared memory, and whether Hopper's wgmma and TMA instructions were emitted where
they were intended.

Two details make the result faithful:
- Under ``TRITON_INTERPRET=1`` the interpreter patches ``triton.language`` in the
  process, which breaks compilation of kernels using its builtins; compiles then
  run in a child process without the interpreter.
- A real launch tells the compiler that tensor pointers are 16-byte aligned (and
  which integer arguments are multiples of 16), which turns element loads into
  128-bit vector loads; ``aligned=True`` and ``divisible=`` give the same hints.
- A kernel with a ``PDL`` constexpr (``qml_kernels.pdl``) is compiled with it on unless
  the request says otherwise: that is how the H200 launches it.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
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


def _compile_here(kernel, signature, constexprs, num_warps, num_stages, arch, aligned, divisible) -> CompileReport:
    fn = _jit_function(kernel)
    name = fn.fn.__name__ if hasattr(fn, "fn") else str(kernel)
    params = [p.name for p in fn.params]
    if "PDL" in params and "PDL" not in signature:
        # a kernel that takes qml_kernels.pdl's constexpr is compiled as the H200 launches it: with
        # its grid-dependency instructions (a request that names PDL decides for itself); in the
        # kernel's argument order, which the divisibility hints below count in
        signature = {n: signature.get(n, "constexpr") for n in params if n in signature or n == "PDL"}
        constexprs = {"PDL": True, **constexprs}
    hinted = {i for i, (arg, ty) in enumerate(signature.items())
              if (aligned and ty.startswith("*")) or arg in divisible}
    attrs = {(i,): [["tt.divisibility", 16]] for i in sorted(hinted)}
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
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


def _kernel_ref(kernel) -> tuple[str, str]:
    fn = kernel.fn if hasattr(kernel, "fn") else kernel
    return fn.__module__, fn.__name__


def _compile_in_child(requests: list[dict]) -> list[CompileReport]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    run = subprocess.run([sys.executable, "-c", "from qml_kernels.workbench.compile import _child_main; _child_main()"],
                         input=pickle.dumps(requests), capture_output=True, env=env)
    if run.returncode != 0:
        error = run.stderr.decode(errors="replace")[-2000:]
        return [CompileReport(r["kernel"][1], ok=False, error=f"compile process failed: {error}") for r in requests]
    return pickle.loads(run.stdout)


def _child_main() -> None:
    import importlib

    requests = pickle.loads(sys.stdin.buffer.read())
    reports = []
    for r in requests:
        module, name = r.pop("kernel")
        reports.append(_compile_here(getattr(importlib.import_module(module), name), **r))
    sys.stdout.buffer.write(pickle.dumps(reports))


def compile_checks(requests: list[dict]) -> list[CompileReport]:
    """Several compiles at once (one child process under the interpreter); each request holds
    ``compile_check``'s arguments as a dict."""
    full = [dict({"num_warps": 4, "num_stages": 3, "arch": 90, "aligned": True, "divisible": ()}, **r)
            for r in requests]
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return [_compile_here(**r) for r in full]
    for r in full:
        r["kernel"] = _kernel_ref(r["kernel"])
    return _compile_in_child(full)


def compile_checks_by_name(requests: dict[str, dict]) -> dict[str, CompileReport]:
    """``compile_checks`` over named requests (a test's variant table) -> report by name."""
    return dict(zip(requests, compile_checks(list(requests.values()))))


def assert_compiled_for_hopper(report: CompileReport, name: str) -> CompileReport:
    """What every kernel's compile test checks first: it compiled, for sm_90a, without spilling
    registers (local-memory round trips in a loop that should stay on chip)."""
    assert report.ok, f"{name}: {report.error}"
    assert ".target sm_90a" in report.ptx, f"{name}: not compiled for sm_90a"
    assert report.spills in (0, None), f"{name}: {report.spills} spill bytes ({report.summary()})"
    return report


# global memory traffic a kernel launched early (programmatic dependent launch) must not start before
# griddepcontrol.wait: loads, stores, async copies and atomics, predicated or not
_GLOBAL_ACCESS = re.compile(r"^\s*(?:@%p\d+\s+)?(ld\.global|st\.global|cp\.async\.(?!wait|commit)|atom\.|red\.)",
                            re.MULTILINE)


@dataclass(frozen=True)
class GridDependencyOrder:
    """Where a kernel's PTX waits for the kernel before it and releases the one after (offsets in
    the PTX text, -1 when absent), and its first global memory access (None: it has none)."""

    wait: int
    release: int
    first_access: int | None
    first_access_op: str | None

    @property
    def safe(self) -> bool:
        """It waits, releases after the wait, and touches global memory only after the wait."""
        return self.wait >= 0 and self.release > self.wait and (
            self.first_access is None or self.first_access > self.wait)


def grid_dependency_order(ptx: str) -> GridDependencyOrder:
    """The order of ``griddepcontrol.wait``, ``griddepcontrol.launch_dependents`` and the first global
    access in ``ptx`` (docs/kernels.md's PDL rule; the tests and notebook 10 check it)."""
    first = _GLOBAL_ACCESS.search(ptx)
    return GridDependencyOrder(ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents"),
                               None if first is None else first.start(), None if first is None else first.group(1))


def compile_check(kernel, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4,
                  num_stages: int = 3, arch: int = 90, aligned: bool = True,
                  divisible: tuple[str, ...] = ()) -> CompileReport:
    """Compile ``kernel`` for sm_{arch}a with the given argument types and constexpr values.

    ``signature`` maps every argument name to Triton's type string ("*bf16", "i32",
    "fp32", "constexpr", ...); ``constexprs`` gives the constexpr values. ``aligned``
    marks pointers 16-byte aligned and ``divisible`` names integer arguments that are
    multiples of 16, as a real launch would. The kernel must be a module-level
    function (the child process imports it by name).
    """
    return compile_checks([dict(kernel=kernel, signature=signature, constexprs=constexprs, num_warps=num_warps,
                                num_stages=num_stages, arch=arch, aligned=aligned, divisible=divisible)])[0]
