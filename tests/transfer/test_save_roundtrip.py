"""Save -> load round trips, bit-exact, for every saver (FlashD2H, per-page copy, GPU-direct via
Triton and via torch, copy engine with and without its GPU-direct fallback) and every loader (FlashH2D via Triton and torch, memcpy): a hybrid batch
(prefill chunks, decode tokens, padding rows) is saved over two steps, then every page a request
owns is loaded back into device slots and compared token by token; rows never saved keep their
sentinel."""
import numpy as np
import pytest
import torch

from sparseserve.transfer import load_pages, make_saver
from sparseserve.transfer.common import count_page_runs, page_runs

from . import DEV, PIN, batch_layout, filled, random_bits, same_bits, sync

SAVERS = [("flash", dict(num_threads=3, staging_bytes=1 << 16, min_rows_per_part=16)),
          ("memcpy", {}), ("gpu-direct", dict(backend="triton")),
          ("gpu-direct", dict(backend="triton", side_stream=False)),
          ("gpu-direct", dict(backend="torch")), ("copy-engine", {}),
          ("copy-engine", dict(max_runs=0))]   # every layer over the GPU-direct fallback
LOADERS = [("flash", "triton"), ("flash", "torch"), ("memcpy", None)]
SENTINEL = 0x3C3C
H, D, L = 2, 32, 2


def _save_steps(saver, hk_layers, T, ps, dtype, seed):
    """Two steps over 3 requests (total new tokens of step 1 = T); returns the reference
    {(layer, page, offset): (k_row, v_row)} and the page tables."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    # step 1: a prefill chunk of most tokens, others appended by two running requests
    n0 = max(T - 2, 1) if T > 2 else T
    rest = T - n0
    lens1 = [0, 5, ps - 1]
    new1 = [n0, rest // 2 if rest else 0, rest - rest // 2 if rest else 0]
    new2 = [1, 1, 1]                                     # step 2: one decode token each
    P = hk_layers[0].shape[0]
    ref = {}
    layouts = []
    need_total = [-(-(b + n1 + n2) // ps) for b, n1, n2 in zip(lens1, new1, new2)]
    pages1, offs1, tables = batch_layout(lens1, [a + b for a, b in zip(new1, new2)], H, ps, P,
                                         rng, pad=0)
    assert all(len(tables[(r, 0)]) == need_total[r] for r in range(3))
    # split the precomputed layout into step 1 and step 2 rows (same page tables)
    rows1, rows2, i = [], [], 0
    for r in range(3):
        n = new1[r] + new2[r]
        rows1 += list(range(i, i + new1[r]))
        rows2 += list(range(i + new1[r], i + n))
        i += n
    for rows, pad in ((rows1, 3 if T > 1 else 1), (rows2, 1)):
        pages, offs = pages1[rows], offs1[rows]
        for _ in range(pad):                                       # padding rows: not saved
            at = int(rng.integers(0, len(pages) + 1))
            pages = np.insert(pages, at, -1, axis=0)
            offs = np.insert(offs, at, 0)
        layouts.append((pages, offs))
    tickets = []
    for pages, offs in layouts:
        for layer in range(L):
            k = random_bits((len(pages), H, D), dtype, gen, DEV)
            v = random_bits((len(pages), H, D), dtype, gen, DEV)
            tickets.append(saver.save(layer, k, v, pages, offs))
            kc, vc = k.cpu(), v.cpu()
            for t in range(len(pages)):
                for h in range(H):
                    if pages[t, h] >= 0:
                        ref[(layer, int(pages[t, h]), int(offs[t]))] = (kc[t, h], vc[t, h])
    return tickets, ref, tables


@pytest.mark.parametrize("saver_name,kw", SAVERS, ids=[s[0] + "-" + str(s[1].get("backend", s[1].get("max_runs", "")))
                                                          for s in SAVERS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ps", [16, 32])
@pytest.mark.parametrize("T", [1, 17, 54, 97])
def test_save_load_roundtrip(saver_name, kw, dtype, ps, T):
    P = 40
    hk = [filled((P, ps, D), dtype, SENTINEL, pin=PIN) for _ in range(L)]
    hv = [filled((P, ps, D), dtype, SENTINEL, pin=PIN) for _ in range(L)]
    saver = make_saver(saver_name, hk, hv, **kw)
    try:
        tickets, ref, tables = _save_steps(saver, hk, T, ps, dtype, seed=T * 7 + ps)
        saver.wait(tickets[-1])
        assert saver.completed_seq() == tickets[-1] == len(tickets)
        st = saver.stats()
        assert st.calls == len(tickets)
        assert st.rows == len(ref) and st.bytes == len(ref) * 2 * D * hk[0].element_size()
    finally:
        saver.close()
    owned = sorted({p for pages in tables.values() for p in pages})
    src = torch.tensor(owned + [-1], device=DEV)                 # one masked entry
    S = len(owned) + 3
    for method, backend in LOADERS:
        for layer in range(L):
            dk = filled((S, ps, D), dtype, SENTINEL + 1, DEV)
            dv = filled((S, ps, D), dtype, SENTINEL + 1, DEV)
            dst = torch.arange(len(owned) + 1, device=DEV)
            load_pages(hk[layer], hv[layer], dk, dv, src, dst, method, backend=backend)
            sync()
            dkc, dvc = dk.cpu(), dv.cpu()
            sent = filled((D,), dtype, SENTINEL)
            for slot, page in enumerate(owned):
                for off in range(ps):
                    want = ref.get((layer, page, off))
                    if want is None:
                        assert same_bits(dkc[slot, off], sent) and same_bits(dvc[slot, off], sent)
                    else:
                        assert same_bits(dkc[slot, off], want[0]), (method, layer, page, off)
                        assert same_bits(dvc[slot, off], want[1]), (method, layer, page, off)
            masked_slot = len(owned)
            assert same_bits(dkc[masked_slot], filled((ps, D), dtype, SENTINEL + 1))


@pytest.mark.parametrize("saver_name,kw", SAVERS[:3])
def test_offsets_per_head_and_untouched_pages(saver_name, kw):
    """offsets may be [T, Hkv]; pages not named keep their bits."""
    dtype, ps, P = torch.bfloat16, 16, 12
    hk = [filled((P, ps, D), dtype, SENTINEL, pin=PIN)]
    hv = [filled((P, ps, D), dtype, SENTINEL, pin=PIN)]
    gen = torch.Generator().manual_seed(0)
    k = random_bits((3, H, D), dtype, gen, DEV)
    v = random_bits((3, H, D), dtype, gen, DEV)
    pages = np.array([[1, 2], [3, -1], [5, 5]])
    offs = np.array([[0, 15], [7, 0], [1, 2]])
    with make_saver(saver_name, hk, hv, **kw) as saver:
        saver.wait(saver.save(0, k, v, pages, offs))
        st = saver.stats()
    assert (st.calls, st.pages, st.rows) == (1, 5, 5)
    kc = k.cpu()
    assert same_bits(hk[0][1, 0], kc[0, 0]) and same_bits(hk[0][2, 15], kc[0, 1])
    assert same_bits(hk[0][3, 7], kc[1, 0]) and same_bits(hk[0][5, 1], kc[2, 0])
    assert same_bits(hk[0][5, 2], kc[2, 1])
    touched = {(1, 0), (2, 15), (3, 7), (5, 1), (5, 2)}
    sent = filled((D,), dtype, SENTINEL)
    for p in range(P):
        for o in range(ps):
            if (p, o) not in touched:
                assert same_bits(hk[0][p, o], sent)


@pytest.mark.parametrize("saver_name,kw", SAVERS)
def test_save_argument_checks(saver_name, kw):
    hk = [torch.zeros(8, 16, D, pin_memory=PIN)]
    hv = [torch.zeros(8, 16, D, pin_memory=PIN)]
    k = torch.zeros(2, H, D, device=DEV)
    with make_saver(saver_name, hk, hv, **kw) as saver:
        with pytest.raises(IndexError):
            saver.save(0, k, k, np.array([[8, 0], [0, 0]]), np.array([0, 1]))      # page >= P
        with pytest.raises(IndexError):
            saver.save(0, k, k, np.array([[1, 0], [0, 0]]), np.array([0, 16]))     # offset
        with pytest.raises(IndexError):
            saver.save(1, k, k, np.zeros((2, H), np.int64), np.array([0, 1]))     # layer
        with pytest.raises(ValueError):
            saver.save(0, k, k[:1], np.zeros((2, H), np.int64), np.array([0, 1]))
        with pytest.raises(ValueError):
            saver.save(0, k, k, np.zeros((3, H), np.int64), np.array([0, 1]))
        t = saver.save(0, k[:0], k[:0], np.zeros((0, H), np.int64), np.zeros(0, np.int64))
        saver.wait(t)
        with pytest.raises(ValueError):
            saver.wait(t + 1)
    with pytest.raises(RuntimeError):
        saver.save(0, k, k, np.zeros((2, H), np.int64), np.array([0, 1]))


@pytest.mark.parametrize("saver_name,kw", SAVERS)
def test_host_layers_not_densely_packed(saver_name, kw):
    """Host tier laid out [P, L, ps, D]: a layer's page stride is L * ps * D."""
    dtype, ps, P = torch.float32, 16, 10
    big = filled((P, L, ps, D), dtype, SENTINEL, pin=PIN)
    bigv = filled((P, L, ps, D), dtype, SENTINEL, pin=PIN)
    hk, hv = [big[:, i] for i in range(L)], [bigv[:, i] for i in range(L)]
    gen = torch.Generator().manual_seed(1)
    T = 20
    k = random_bits((T, H, D), dtype, gen, DEV)
    v = random_bits((T, H, D), dtype, gen, DEV)
    pages = np.stack([np.arange(T) // ps, 5 + np.arange(T) // ps], 1)
    offs = np.arange(T) % ps
    with make_saver(saver_name, hk, hv, **kw) as saver:
        saver.wait(saver.save(1, k, v, pages, offs))
    kc, vc = k.cpu(), v.cpu()
    for t in range(T):
        for h in range(H):
            assert same_bits(big[pages[t, h], 1, offs[t]], kc[t, h])
            assert same_bits(bigv[pages[t, h], 1, offs[t]], vc[t, h])
    assert same_bits(big[:, 0], filled((P, ps, D), dtype, SENTINEL))      # layer 0 untouched
    # and FlashH2D / memcpy read them back
    src = torch.tensor([0, 1, 5, 6], device=DEV)
    for method, backend in LOADERS:
        dk = filled((4, ps, D), dtype, 0, DEV)
        dv = filled((4, ps, D), dtype, 0, DEV)
        load_pages(hk[1], hv[1], dk, dv, src, torch.arange(4, device=DEV), method, backend=backend)
        sync()
        for i, p in enumerate([0, 1, 5, 6]):
            assert same_bits(dk[i], big[p, 1]) and same_bits(dv[i], bigv[p, 1])


def test_page_runs_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(50):
        T, Hh = int(rng.integers(1, 30)), int(rng.integers(1, 4))
        pages = rng.integers(-1, 3, (T, Hh))
        offs = rng.integers(0, 4, (T, 1)) if rng.random() < 0.5 else rng.integers(0, 4, (T, Hh))
        ob = np.broadcast_to(offs, (T, Hh))
        want = []
        for h in range(Hh):
            t = 0
            while t < T:
                if pages[t, h] < 0:
                    t += 1
                    continue
                n = 1
                while t + n < T and pages[t + n, h] == pages[t, h] and ob[t + n, h] == ob[t, h] + n:
                    n += 1
                want.append((h, t, n, pages[t, h], ob[t, h]))
                t += n
        got = list(zip(*[a.tolist() for a in page_runs(pages, offs)]))
        assert got == want
        cut = int(rng.integers(0, T + 1))
        assert count_page_runs(pages, offs, 0, cut) + count_page_runs(pages, offs, cut, T) == len(want)
