"""Store each decode token's K/V into the device slot of its page (two-tier cache decode).

After retrieve, the token's page is the last valid entry of its selection row, now resident in
a slot. One program per (request, KV head) reads that slot, writes the token's K and V row
into it at the token's offset and returns the slot (the caller indexes the page from it when
the token fills it). Replaces a gather + two index_puts and their index arithmetic (~8
launches per layer) with one. With a stage it also copies the rows into a device buffer
[B, Hkv, D], from which one launch per step writes every layer's rows through to DRAM
(worker/decode_write_through.py): writing them to pinned host memory from this kernel made
each layer's launch wait for its PCIe writes (~12 us instead of ~3 on the H200, light8
profile, fourteenth session). Fixed grid, no host sync: capturable in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["store_decode_tokens", "torch_store_decode_tokens"]


# sizes that change from step to step are not specialised on (== 1, % 16): a new size
# class would compile a variant mid-serving, which the start-up warm-up cannot foresee
@triton.jit(do_not_specialize=["K"])
def _store_kernel(slots_ptr, nsel_ptr, offs_ptr, k_ptr, v_ptr, dk_ptr, dv_ptr, out_ptr,
                  sk_ptr, sv_ptr, Hkv, K, S, stride_kb, stride_kh, stride_vb, stride_vh,
                  stride_ds, stride_dt, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_STAGE: tl.constexpr):
    i = tl.program_id(0)
    b = i // Hkv
    h = i % Hkv
    n = tl.load(nsel_ptr + i)
    slot = tl.load(slots_ptr + i * K + tl.maximum(n - 1, 0)).to(tl.int64)
    off = tl.load(offs_ptr + b).to(tl.int64)
    tl.device_assert((slot >= 0) & (slot < S), "slot_store: slot out of range")
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    dst = slot * stride_ds + off * stride_dt + d
    x = tl.load(k_ptr + b * stride_kb + h * stride_kh + d, mask=ok)
    tl.store(dk_ptr + dst, x, mask=ok)
    if HAS_STAGE:
        tl.store(sk_ptr + i.to(tl.int64) * D + d, x, mask=ok)
    x = tl.load(v_ptr + b * stride_vb + h * stride_vh + d, mask=ok)
    tl.store(dv_ptr + dst, x, mask=ok)
    if HAS_STAGE:
        tl.store(sv_ptr + i.to(tl.int64) * D + d, x, mask=ok)
    tl.store(out_ptr + i, slot)


def store_decode_tokens(slots: torch.Tensor, num_sel: torch.Tensor, offsets: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, dev_k: torch.Tensor,
                        dev_v: torch.Tensor, stage: tuple | None = None, *,
                        backend: str | None = None) -> torch.Tensor:
    """dev_k/dev_v[slots[b, h, num_sel[b, h] - 1], offsets[b]] = k/v[b, h], and with
    stage = (stage_k, stage_v): stage_k/stage_v[b, h] = k/v[b, h] too.

    slots [B, Hkv, K] int (retrieve's output, contiguous), num_sel [B, Hkv] int (>= 1),
    offsets [B] int (the token's offset in its page), k/v [B, Hkv, D] (last dim contiguous),
    dev_k/dev_v [S, page_size, D] (contiguous), stage_k/stage_v [B, Hkv, D] contiguous on
    k's device. -> last slot [B, Hkv] int64. Triton on CUDA tensors, the torch version
    otherwise (``backend`` as in kernels/)."""
    from . import resolve_backend
    if resolve_backend(backend, k) == "torch":
        return torch_store_decode_tokens(slots, num_sel, offsets, k, v, dev_k, dev_v, stage)
    B, Hkv, K = slots.shape
    D = k.shape[-1]
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and dev_k.is_contiguous()
    out = torch.empty((B, Hkv), dtype=torch.int64, device=k.device)
    sk, sv = stage if stage is not None else (dev_k, dev_v)
    assert sk.is_contiguous() and sv.is_contiguous()
    if stage is not None:
        assert sk.shape == (B, Hkv, D) and sv.shape == (B, Hkv, D)
    _store_kernel[(B * Hkv,)](slots.contiguous(), num_sel.contiguous(), offsets.contiguous(),
                              k, v, dev_k, dev_v, out, sk, sv, Hkv, K, dev_k.shape[0],
                              k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                              dev_k.stride(0), dev_k.stride(1), D=D,
                              BLOCK_D=triton.next_power_of_2(D), HAS_STAGE=stage is not None,
                              num_warps=1)
    return out


def torch_store_decode_tokens(slots, num_sel, offsets, k, v, dev_k, dev_v,
                              stage=None) -> torch.Tensor:
    """Same contract with torch indexing (CPU engine path; the reference of the kernel)."""
    last = slots.gather(2, (num_sel.long() - 1).clamp(min=0).unsqueeze(-1))[..., 0].long()
    offs = offsets.long().view(-1, 1)
    dev_k[last, offs] = k
    dev_v[last, offs] = v
    if stage is not None:
        stage[0].copy_(k)
        stage[1].copy_(v)
    return last
