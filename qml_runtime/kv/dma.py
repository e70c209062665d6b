"""2D copies by the copy engines (``cudaMemcpy2DAsync``), which torch does not expose.

The staged host restore (``HostRestores._upload_staged``) moves g layers of every page of a slot run in one
copy: ``height`` host rows, ``width`` bytes from each (the rows' g layers, consecutive in a row), into a
packed device staging region. The call goes through ctypes to the CUDA runtime torch itself loaded (found
in this process's mapped libraries), so streams and pointers are the ones torch hands out.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_runtime: ctypes.CDLL | None = None


def _loaded_cudart() -> str | None:
    """The path of the libcudart this process has mapped (torch's), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


def cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch uses (loaded once): the one mapped in this process, else the first
    ``libcudart.so*`` under the nvidia wheels or torch's own directory."""
    global _runtime
    if _runtime is not None:
        return _runtime
    torch.cuda.init()
    candidates = [p for p in [_loaded_cudart()] if p]
    try:
        import nvidia

        for base in getattr(nvidia, "__path__", []):
            candidates += sorted(glob.glob(os.path.join(base, "**", "libcudart.so*"), recursive=True), reverse=True)
    except ImportError:
        pass
    candidates += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart.so*")),
                         reverse=True) + ["libcudart.so"]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError:
            continue
    else:
        raise RuntimeError("no CUDA runtime library found for 2D copies")
    lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaMemcpy2DAsync.restype = ctypes.c_int
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostRegister.restype = ctypes.c_int
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaHostUnregister.restype = ctypes.c_int
    lib.cudaGetLastError.restype = ctypes.c_int
    _runtime = lib
    return lib


def copy_2d_to_device(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                      stream: torch.cuda.Stream) -> None:
    """``height`` rows of ``width`` bytes from pinned host address ``src`` (rows ``src_pitch`` apart) to
    device address ``dst`` (rows ``dst_pitch`` apart), queued on ``stream``."""
    err = cudart().cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, _HOST_TO_DEVICE,
                                     ctypes.c_void_p(stream.cuda_stream))
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")


_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


def host_register(ptr: int, size: int) -> None:
    """Page-lock ``size`` bytes of host memory at ``ptr`` (allocated elsewhere: a memfd's mapping) for every
    device, mapped into the device's address space, as ``pin_memory`` allocations are."""
    err = cudart().cudaHostRegister(ptr, size, _REGISTER_PORTABLE_MAPPED)
    if err:
        # the runtime keeps a failed call's error for the next cudaGetLastError: torch's check after its next
        # kernel launch would raise it there (712, a range registered already, failed five GPU tests so)
        cudart().cudaGetLastError()
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {err}")


def host_unregister(ptr: int) -> None:
    """Undo ``host_register`` (its pages stay locked until then, even once unmapped, and the range cannot be
    registered again: a later mapping at the same address could not be pinned). Errors are cleared, not
    raised: this runs when the rows are freed."""
    if cudart().cudaHostUnregister(ptr):
        cudart().cudaGetLastError()
