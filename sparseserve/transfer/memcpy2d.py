"""Strided device-to-host copies in one DMA call: ``cudaMemcpy2DAsync``.

A prefill step's rows of one layer land in the host tier as a few long runs plus, where the
step starts or ends inside a page or chunk, one short run per KV head — all of the same length,
``pitch`` host rows apart (save_plan.dest_blocks). torch has no strided device-to-host copy
that stays asynchronous (a non-contiguous destination goes through a host temporary), so
those runs would be one ``copy_`` each (~33 per K and V per layer on an MHA model). The CUDA
runtime copies such a block of equally spaced runs in one call; torch already loads the
runtime library, so it is called through ctypes (no extra dependency).

On CPU tensors (tests, the interpreter path) the same block is copied through an
``as_strided`` view: the contract is the same.
"""
from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["copy_rows_2d", "cuda_2d_available"]

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses


@functools.lru_cache(maxsize=1)
def _cudart():
    """The CUDA runtime torch loaded (found in this process's mappings), or None."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    names = []
    try:
        with open("/proc/self/maps") as maps:
            names = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        pass
    for name in names + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        return lib
    return None


def cuda_2d_available() -> bool:
    """True when strided copies of CUDA tensors run as one DMA call (the runtime was found)."""
    return _cudart() is not None


def copy_rows_2d(dst: torch.Tensor, dst_row: int, dst_pitch: int, src: torch.Tensor,
                 src_row: int, length: int, height: int) -> None:
    """dst[dst_row + i * dst_pitch + j] = src[src_row + i * length + j] for i < height,
    j < length: `height` runs of `length` rows, consecutive in src, `dst_pitch` rows apart in
    dst. dst [R, D] (host rows, dense), src [S, D] (dense; CUDA: the current stream's
    device). On CUDA asynchronous on the current stream (the caller keeps src alive until
    the stream passes it); on CPU done on return."""
    D = dst.shape[1]
    if src.device.type != "cuda":
        view = dst.as_strided((height, length, D), (dst_pitch * D, D, 1),
                              dst.storage_offset() + dst_row * D)
        view.copy_(src[src_row:src_row + height * length].view(height, length, D))
        return
    lib = _cudart()
    row = D * dst.element_size()
    stream = torch.cuda.current_stream(src.device).cuda_stream
    err = lib.cudaMemcpy2DAsync(dst.data_ptr() + dst_row * row, dst_pitch * row,
                                src.data_ptr() + src_row * row, length * row, length * row,
                                height, _MEMCPY_DEFAULT, stream)
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync failed: "
                           f"{lib.cudaGetErrorString(err).decode(errors='replace')}")
