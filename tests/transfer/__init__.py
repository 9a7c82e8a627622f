"""Tests of sparseserve.transfer, plus the helpers they share (kept here so the directory holds
only test modules besides this one).

The device is decided once, in tests/conftest.py (``DEVICE``): on a CUDA machine the device tier
lives on the GPU, the host tier in pinned memory (the real UVA paths) and the Triton kernels are
compiled; elsewhere both tiers are CPU tensors and the kernels run in the interpreter.
Transfers are bit-exact: no tolerances.
"""
import numpy as np
import torch

from sparseserve.transfer import bits_view

from tests.conftest import DEVICE

DEV = DEVICE.type          # the device tier's device
PIN = DEV == "cuda"        # the host tier is pinned exactly when there is a device to copy to


def random_bits(shape, dtype, gen: torch.Generator, device="cpu", pin=False) -> torch.Tensor:
    """A tensor of `dtype` with random bit patterns (NaN payloads and all: tests are bit-exact)."""
    esz = torch.empty((), dtype=dtype).element_size()
    ints = {2: torch.int16, 4: torch.int32}[esz]
    info = torch.iinfo(ints)
    t = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(ints)
    t = t.view(dtype)
    if pin:
        t = t.pin_memory()
    return t.to(device)


def filled(shape, dtype, value: int, device="cpu", pin=False) -> torch.Tensor:
    """A tensor whose every element has the bit pattern `value` (a sentinel)."""
    esz = torch.empty((), dtype=dtype).element_size()
    ints = {2: torch.int16, 4: torch.int32}[esz]
    t = torch.full(shape, value, dtype=ints, pin_memory=pin).view(dtype)
    return t.to(device) if device != "cpu" else t


def host_tier(P, ps, D, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Host K and V tiers [P, ps, D] of random bits (pinned on a GPU machine)."""
    return (random_bits((P, ps, D), dtype, gen, pin=PIN), random_bits((P, ps, D), dtype, gen, pin=PIN))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, whatever device each side is on."""
    return torch.equal(bits_view(a.cpu().contiguous()), bits_view(b.cpu().contiguous()))


def sync() -> None:
    """Wait for the device's queued copies and kernels (no-op on CPU)."""
    if DEV == "cuda":
        torch.cuda.synchronize()


def batch_layout(lens_before, new_tokens, H, ps, P, rng: np.random.Generator, pad: int = 0):
    """Page ids and offsets of one step's new KV, like a hybrid batch: request r has
    lens_before[r] tokens saved already and appends new_tokens[r]; each (request, head) owns a
    random list of host pages. `pad` extra rows (page -1) are mixed in.

    -> pages [T, H] int64, offsets [T] int64, page_tables {(r, h): [page ids]}"""
    need = [-(-(b + n) // ps) for b, n in zip(lens_before, new_tokens)]
    perm = rng.permutation(P)
    assert sum(need) * H <= P, "host tier too small for the layout"
    tables, k = {}, 0
    for r, n in enumerate(need):
        for h in range(H):
            tables[(r, h)] = perm[k:k + n].tolist()
            k += n
    pages, offs = [], []
    for r, (b, n) in enumerate(zip(lens_before, new_tokens)):
        for pos in range(b, b + n):
            pages.append([tables[(r, h)][pos // ps] for h in range(H)])
            offs.append(pos % ps)
    for _ in range(pad):
        at = int(rng.integers(0, len(pages) + 1))
        pages.insert(at, [-1] * H)
        offs.insert(at, 0)
    return np.array(pages, dtype=np.int64).reshape(-1, H), np.array(offs, dtype=np.int64), tables
