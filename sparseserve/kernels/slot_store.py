"""Store K/V rows into device slots (two-tier cache): a decode step's one token per request
(`store_decode_tokens`) and a prefill chunk's tokens (`store_token_rows`).

After retrieve, the token's page is the last valid entry of its selection row, now resident in
a slot. One program per (request, KV head) reads that slot, writes the token's K and V row
into it at the token's offset and returns the slot (the caller indexes the page from it when
the token fills it). Replaces a gather + two index_puts and their index arithmetic (~8
launches per layer) with one. With a stage it also copies the rows into a device buffer
[B, Hkv, D], from which one launch per step writes every layer's rows through to DRAM
(worker/decode_write_through.py): writing them to pinned host memory from this kernel made
each layer's launch wait for its PCIe writes (~12 us instead of ~3 on the H200, light8
profile, fourteenth session). Fixed grid, no host sync: capturable in a CUDA graph.

A prefill chunk's rows go where retrieve mapped their pages: ``dev[slot[h, t], off[t]] =
k[t, h]``. As a torch index_put on the chunk's [Hkv, T] transposed view that was a contiguous
copy plus a two-index scatter per K and V (~60-100 us each for a 4,096-token MHA layer on the
H200: profile of a layer-segmented step, fifteenth session); one launch here reads each row
once where it lies (a strided view of the qkv output) and writes it once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["store_decode_tokens", "torch_store_decode_tokens", "store_token_rows",
           "torch_store_token_rows"]


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


# T and the entry table's strides follow the step's tokens (a one-entry step makes one of
# them 1): not specialised, else a new class compiles mid-serving
@triton.jit(do_not_specialize=["T", "stride_st", "stride_sh"])
def _store_rows_kernel(slots_ptr, offs_ptr, ent_ptr, k_ptr, v_ptr, dk_ptr, dv_ptr, T, S,
                       stride_st, stride_sh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_ds, stride_dt, D: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_D: tl.constexpr, GATHER: tl.constexpr):
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    col = t
    if GATHER:  # the token's slot is its page entry's: slots[h, entries[t]]
        col = tl.load(ent_ptr + t, mask=tm, other=0)
    slot = tl.load(slots_ptr + h * stride_sh + col * stride_st, mask=tm, other=0).to(tl.int64)
    off = tl.load(offs_ptr + t, mask=tm, other=0).to(tl.int64)
    tl.device_assert(~tm | ((slot >= 0) & (slot < S)), "store_token_rows: slot out of range")
    d = tl.arange(0, BLOCK_D)
    m = tm[:, None] & (d < D)[None, :]
    dst = (slot * stride_ds + off * stride_dt)[:, None] + d[None, :]
    t64 = t.to(tl.int64)
    x = tl.load(k_ptr + (t64 * stride_kt + h * stride_kh)[:, None] + d[None, :], mask=m)
    tl.store(dk_ptr + dst, x, mask=m)
    x = tl.load(v_ptr + (t64 * stride_vt + h * stride_vh)[:, None] + d[None, :], mask=m)
    tl.store(dv_ptr + dst, x, mask=m)


def store_token_rows(tok_slots: torch.Tensor, tok_off: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, dev_k: torch.Tensor, dev_v: torch.Tensor, *,
                     tok_entry: torch.Tensor | None = None,
                     backend: str | None = None) -> None:
    """dev_k/dev_v[tok_slots[h, t], tok_off[t]] = k/v[t, h] for every t < T, h < Hkv.

    tok_slots [Hkv, T] int (any strides), tok_off [T] int (contiguous), k/v [T, Hkv, D]
    (last dim contiguous, any row strides: e.g. column slices of the qkv output), dev_k/dev_v
    [S, page_size, D] (contiguous). Distinct (slot, offset) pairs. Triton on CUDA tensors,
    the torch version otherwise (``backend`` as in kernels/).
    tok_entry [T] int (contiguous): tok_slots is then [Hkv, E], the slots of the chunk's page
    entries, and token t's slot is tok_slots[h, tok_entry[t]] (the gather done in the kernel,
    not by an index launch before it)."""
    from . import resolve_backend
    if resolve_backend(backend, k) == "torch":
        if tok_entry is not None:
            tok_slots = tok_slots[:, tok_entry]
        return torch_store_token_rows(tok_slots, tok_off, k, v, dev_k, dev_v)
    T, Hkv, D = k.shape
    if T == 0:
        return None
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and dev_k.is_contiguous()
    assert dev_v.is_contiguous() and tok_off.shape == (T,)
    assert tok_slots.shape[0] == Hkv and (tok_entry is not None or tok_slots.shape[1] == T)
    tok_off = tok_off.contiguous()
    if tok_entry is not None:
        assert tok_entry.shape == (T,)
        tok_entry = tok_entry.contiguous()
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_T = max(1, min(64, 8192 // BLOCK_D))  # a [BLOCK_T, D] tile of 16-32 KB
    grid = (triton.cdiv(T, BLOCK_T), Hkv)
    _store_rows_kernel[grid](tok_slots, tok_off, tok_off if tok_entry is None else tok_entry,
                             k, v, dev_k, dev_v, T, dev_k.shape[0],
                             tok_slots.stride(1), tok_slots.stride(0), k.stride(0),
                             k.stride(1), v.stride(0), v.stride(1), dev_k.stride(0),
                             dev_k.stride(1), D=D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
                             GATHER=tok_entry is not None)
    return None


def torch_store_token_rows(tok_slots, tok_off, k, v, dev_k, dev_v) -> None:
    """Same contract with torch indexing (CPU engine path; the reference of the kernel)."""
    offs = tok_off.long()[None, :]
    dev_k[tok_slots.long(), offs] = k.transpose(0, 1)
    dev_v[tok_slots.long(), offs] = v.transpose(0, 1)
