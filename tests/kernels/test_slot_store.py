"""Decode tokens and prefill chunks stored into the slots of their pages (kernels/slot_store.py):
the Triton kernels (compiled on CUDA, interpreted on CPU) against their torch versions and a
loop reference, at odd sizes, non-contiguous K/V rows (views of a fused QKV output)."""
import pytest
import torch

from sparseserve.kernels.slot_store import (store_decode_tokens, store_token_rows,
                                            torch_store_decode_tokens, torch_store_token_rows)

from tests.conftest import DEVICE


@pytest.mark.parametrize("B,Hkv,K,D", [(1, 1, 1, 64), (17, 2, 9, 128), (5, 8, 54, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_decode_tokens(B, Hkv, K, D, dtype):
    g = torch.Generator().manual_seed(B * K + D)
    S, ps = B * Hkv * K + 3, 16
    slots = torch.randperm(S, generator=g)[:B * Hkv * K].view(B, Hkv, K).to(torch.int32)
    num_sel = torch.randint(1, K + 1, (B, Hkv), generator=g, dtype=torch.int32)
    offs = torch.randint(0, ps, (B,), generator=g)
    qkv = torch.randn(B, 3 * Hkv, D, generator=g).to(dtype)
    k, v = qkv[:, :Hkv], qkv[:, Hkv:2 * Hkv]  # strided rows, as from a QKV projection
    base_k = torch.randn(S, ps, D, generator=g).to(dtype)
    base_v = torch.randn(S, ps, D, generator=g).to(dtype)
    ref_k, ref_v = base_k.clone(), base_v.clone()
    want = torch.empty(B, Hkv, dtype=torch.long)
    for b in range(B):
        for h in range(Hkv):
            s = int(slots[b, h, num_sel[b, h] - 1])
            want[b, h] = s
            ref_k[s, offs[b]] = k[b, h]
            ref_v[s, offs[b]] = v[b, h]
    for fn in (lambda *a: store_decode_tokens(*a, backend="triton"), torch_store_decode_tokens):
        dk, dv = base_k.clone().to(DEVICE), base_v.clone().to(DEVICE)
        last = fn(slots.to(DEVICE), num_sel.to(DEVICE), offs.to(DEVICE), k.to(DEVICE),
                  v.to(DEVICE), dk, dv)
        assert torch.equal(last.cpu(), want)
        assert torch.equal(dk.cpu(), ref_k) and torch.equal(dv.cpu(), ref_v)


@pytest.mark.parametrize("B,Hkv", [(1, 1), (17, 2), (54, 1), (97, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_decode_tokens_stages_rows(B, Hkv, dtype):
    """With a stage the same launch also copies each row to stage[b, h] (what the step's one
    DRAM write-through reads); the device side as without."""
    g = torch.Generator().manual_seed(B + Hkv)
    K, D, ps = 3, 64, 16
    S = B * Hkv * K + 1
    slots = torch.randperm(S, generator=g)[:B * Hkv * K].view(B, Hkv, K).to(torch.int32)
    num_sel = torch.randint(1, K + 1, (B, Hkv), generator=g, dtype=torch.int32)
    offs = torch.randint(0, ps, (B,), generator=g)
    qkv = torch.randn(B, 3 * Hkv, D, generator=g).to(dtype)
    k, v = qkv[:, :Hkv], qkv[:, Hkv:2 * Hkv]
    base = torch.randn(2, S, ps, D, generator=g).to(dtype)
    outs = []
    for fn in (lambda *a: store_decode_tokens(*a, backend="triton"), torch_store_decode_tokens):
        dk, dv = base[0].clone().to(DEVICE), base[1].clone().to(DEVICE)
        stage = torch.full((2, B, Hkv, D), float("nan"), dtype=dtype, device=DEVICE)
        last = fn(slots.to(DEVICE), num_sel.to(DEVICE), offs.to(DEVICE), k.to(DEVICE),
                  v.to(DEVICE), dk, dv, (stage[0], stage[1]))
        assert torch.equal(stage[0].cpu(), k) and torch.equal(stage[1].cpu(), v)
        outs.append((last.cpu(), dk.cpu(), dv.cpu()))
    pk, pv = base[0].clone(), base[1].clone()
    plain = torch_store_decode_tokens(slots, num_sel, offs, k, v, pk, pv)
    for last, dk, dv in outs:
        assert torch.equal(last, plain) and torch.equal(dk, pk) and torch.equal(dv, pv)


@pytest.mark.parametrize("T,Hkv,D", [(1, 1, 64), (17, 2, 128), (54, 8, 96), (97, 3, 64),
                                     (4097, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_token_rows(T, Hkv, D, dtype):
    """A prefill chunk's rows into their pages' slots: Triton (compiled on CUDA, interpreted on
    CPU) and torch == a loop reference; K/V as column slices of a fused QKV output, slots as a
    column gather of the mapped pages (strided), the chunk starting mid-page; nothing else
    written."""
    g = torch.Generator().manual_seed(T * Hkv + D)
    ps, start = 16, 5
    nb = (start + T + ps - 1) // ps
    S = Hkv * nb + 4
    page_slots = torch.randperm(S, generator=g)[:Hkv * nb].view(Hkv, nb)
    pos = torch.arange(start, start + T)
    tok_slots = page_slots[:, pos // ps]              # [Hkv, T]
    tok_off = pos % ps
    qkv = torch.randn(T, 3 * Hkv, D, generator=g).to(dtype)
    k, v = qkv[:, Hkv:2 * Hkv], qkv[:, 2 * Hkv:]
    base_k = torch.randn(S, ps, D, generator=g).to(dtype)
    base_v = torch.randn(S, ps, D, generator=g).to(dtype)
    ref_k, ref_v = base_k.clone(), base_v.clone()
    for t in range(T):
        for h in range(Hkv):
            ref_k[tok_slots[h, t], tok_off[t]] = k[t, h]
            ref_v[tok_slots[h, t], tok_off[t]] = v[t, h]
    for fn in (lambda *a: store_token_rows(*a, backend="triton"), torch_store_token_rows):
        dk, dv = base_k.clone().to(DEVICE), base_v.clone().to(DEVICE)
        fn(page_slots.to(DEVICE)[:, (pos // ps).to(DEVICE)], tok_off.to(DEVICE),
           qkv.to(DEVICE)[:, Hkv:2 * Hkv], qkv.to(DEVICE)[:, 2 * Hkv:], dk, dv)
        assert torch.equal(dk.cpu(), ref_k) and torch.equal(dv.cpu(), ref_v)
    # the gather in the kernel: the page entries' slots [Hkv, nb] (column-major strides) and
    # each token's entry
    ents = (pos // ps).to(DEVICE)
    for be in ("triton", "torch"):
        dk, dv = base_k.clone().to(DEVICE), base_v.clone().to(DEVICE)
        store_token_rows(page_slots.to(DEVICE).t().contiguous().t(), tok_off.to(DEVICE),
                         qkv.to(DEVICE)[:, Hkv:2 * Hkv], qkv.to(DEVICE)[:, 2 * Hkv:], dk, dv,
                         tok_entry=ents, backend=be)
        assert torch.equal(dk.cpu(), ref_k) and torch.equal(dv.cpu(), ref_v)
