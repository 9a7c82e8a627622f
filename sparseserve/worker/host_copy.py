"""Small host -> device copies that do not stall the host.

`torch.tensor(values, device="cuda")` builds the tensor in pageable host memory and copies it
synchronously: the host waits until everything queued on the stream before the copy (the
step's forward pass, say) has run. The sampler builds a handful of such tensors whenever the
batch composition changes (per-row temperatures, penalty rows, logit_bias entries, ...), so
each of those steps would otherwise stall the host once per tensor.

Contract of `to_device(values, dtype, device)`:
* `values`: a sequence (list, tuple, numpy array) of numbers or bools, possibly empty;
  `dtype` None infers it as `torch.tensor` does.
* On a CUDA device the values are staged in pinned host memory and copied with
  `non_blocking=True` on the current stream: kernels queued after it on that stream see the
  values, and the host does not wait. The staging block comes from PyTorch's caching host
  allocator, which does not hand it out again before the copy has finished, so the caller
  may drop the host tensor at once.
* On the CPU it is `torch.tensor(values, dtype=dtype)`; on another device that tensor
  copied there (synchronously).

The sampler's modules (sampling_tensors, penalties, min_tokens, grammar, prompt_logprobs)
build every device tensor from host values through `to_device`, never with
`torch.tensor(..., device=...)` (tests/worker/test_host_copy.py checks a sampler step).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

ALIGN_WORDS = 4  # int32 words per 16 bytes: pack_to_device's array alignment


def to_device(values: Any, dtype: Optional[torch.dtype], device: torch.device | str) -> torch.Tensor:
    """`values` as a tensor on `device` (see the module docstring for the copy's contract)."""
    device = torch.device(device)
    if device.type == "cuda":
        # torch.tensor(..., pin_memory=True) refuses numpy arrays ("Can't pin tensor
        # constructed from numpy"), and the page lists of prefill arrive as numpy: build the
        # host tensor first, then pin it (one extra copy of a few hundred bytes).
        host = torch.tensor(values, dtype=dtype).pin_memory()
        return host.to(device, non_blocking=True)
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.to(device)


def fill_at(target: torch.Tensor, index: tuple[torch.Tensor, ...], value: float | bool) -> None:
    """In place: `target[index] = value` for a tuple of device index tensors, without a host
    sync. (`target[idx] = scalar` wraps the scalar in a CPU tensor that index_put_ copies to
    the device synchronously; a 0-dim device tensor built by a fill kernel is not copied.)"""
    target.index_put_(index, torch.full((), value, dtype=target.dtype, device=target.device))


def pack_to_device(p64: dict[str, np.ndarray], p32: dict[str, np.ndarray],
                   device: torch.device) -> dict[str, torch.Tensor]:
    """Host arrays as device tensors of their shapes (p64: int64, p32: int32) through one
    host-to-device copy: one int32 buffer, the int64 ones first and viewed back as int64.
    Every array starts at a multiple of 16 bytes (ALIGN_WORDS int32 words): Triton specialises
    a kernel on its pointers' 16-byte alignment, so an offset that moved with the arrays'
    sizes would compile a new variant mid-serving (serving.md, twentieth session)."""
    parts: list[np.ndarray] = []
    offsets: list[tuple[str, int, tuple, bool]] = []  # name, int32 word offset, shape, is 64
    o = 0
    for arrays, is64 in ((p64, True), (p32, False)):
        for name, a in arrays.items():
            flat = np.ascontiguousarray(a, dtype=np.int64 if is64 else np.int32).reshape(-1)
            words = flat.view(np.int32)
            pad = -words.size % ALIGN_WORDS
            parts += [words, np.zeros(pad, np.int32)]
            offsets.append((name, o, np.shape(a), is64))
            o += words.size + pad
    buf = to_device(np.concatenate(parts + [np.zeros(1, np.int32)]), torch.int32, device)
    out: dict[str, torch.Tensor] = {}
    for name, start, shape, is64 in offsets:
        n = int(np.prod(shape, dtype=np.int64))
        if is64:
            out[name] = buf[start:start + 2 * n].view(torch.int64).view(shape)
        else:
            out[name] = buf[start:start + n].view(shape)
    return out
