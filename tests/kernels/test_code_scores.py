"""Key-code page scores (``code_scores.code_page_bounds``, compiled on CUDA, interpreted on
CPU) against ``ref.code_page_bounds`` on DEVICE, and the reference against an explicit
decode of the approximate keys (``KeyCodes.approx_keys``), at 1, 17, 54, 97 and 4097 pages,
GQA and MHA, 1 and 2 bits, page sizes 16 and 32."""
import pytest
import torch

from sparseserve.kernels import code_page_bounds as dispatch
from sparseserve.kernels import ref
from sparseserve.kernels.code_scores import code_page_bounds
from sparseserve.sparse import get_algorithm_class

from tests.conftest import DEVICE
from tests.kernels import close, to_dev


def _case(npages, Hq, Hkv, D, ps, bits, gen, dtype=torch.float32):
    B = len(npages)
    W = max(npages)
    P = B * Hkv * W
    alg = get_algorithm_class(f"keycode{bits}")(ps, 8, 1, 1)
    k = torch.randn(P, ps, D, generator=gen)
    summ = alg.make_summaries(P + 1, D, dtype)
    alg.index(k, torch.arange(P, dtype=torch.int32), torch.full((P,), ps, dtype=torch.int32),
              summ, None)
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    table = torch.randperm(P, generator=gen)[:B * Hkv * W].view(B, Hkv, W).to(torch.int32)
    num = torch.tensor(npages, dtype=torch.int32).view(B, 1).repeat(1, Hkv)
    num[:, -1] = (num[:, -1] - 1).clamp(min=1)  # vary rows
    table = torch.where(torch.arange(W).view(1, 1, W) < num.unsqueeze(-1), table, 99999)
    return alg, summ, q, table, num


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 32), (4, 4, 16), (9, 3, 64), (4, 2, 48)])
@pytest.mark.parametrize("ps", [16, 32])
def test_code_scores_match_reference(bits, Hq, Hkv, D, ps):
    gen = torch.Generator().manual_seed(bits * 7 + Hq + ps)
    alg, summ, q, table, num = _case([1, 17, 54, 97], Hq, Hkv, D, ps, bits, gen)
    want = ref.code_page_bounds(*to_dev(q, summ["kmin"], summ["kmax"], summ["codes"], table,
                                        num), bits)
    got = code_page_bounds(*to_dev(q, summ["kmin"], summ["kmax"], summ["codes"], table, num),
                           bits)
    assert got.device.type == DEVICE.type
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and (got[~fin] == float("-inf")).all()
    close(got[fin], want[fin], rtol=1e-4, atol=1e-3)
    # the reference is the decode of the approximate keys, explicitly
    B, _, W = table.shape
    ok = torch.arange(W).view(1, 1, W) < num.unsqueeze(-1)
    kh = alg.approx_keys(summ, torch.where(ok, table.long(), 0))  # [B, Hkv, W, ps, D]
    x = torch.einsum("bhgd,bhwtd->bhgwt", q.view(B, Hkv, Hq // Hkv, D), kh) * D ** -0.5
    explicit = torch.logsumexp(x.double(), -1) / D ** -0.5
    torch.testing.assert_close(want.cpu()[fin.cpu()].double(), explicit[fin.cpu()],
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(dispatch(q, summ["kmin"], summ["kmax"], summ["codes"], table, num, bits,
                                backend="torch"), ref.code_page_bounds(
        q, summ["kmin"], summ["kmax"], summ["codes"], table, num, bits))


def test_code_scores_wide_row_and_half_summaries():
    """4097 pages; bf16 box rows (the codes stay int32)."""
    gen = torch.Generator().manual_seed(3)
    for dtype, npages in ((torch.float32, [4097, 5]), (torch.bfloat16, [300, 97])):
        _, summ, q, table, num = _case(npages, 6, 2, 32, 16, 2, gen, dtype)
        args = (q, summ["kmin"], summ["kmax"], summ["codes"], table, num)
        want = ref.code_page_bounds(*to_dev(*args), 2)
        got = code_page_bounds(*to_dev(*args), 2)
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got))
        if dtype == torch.float32:
            close(got[fin], want[fin], rtol=1e-4, atol=1e-3)
        else:  # on CUDA the dot runs in bf16 (decoded keys rounded): TOL[bf16]
            close(got[fin], want[fin], dtype)


def test_pack_unpack_roundtrip():
    from sparseserve.sparse.keycodes import pack_codes, unpack_codes
    gen = torch.Generator().manual_seed(0)
    for bits in (1, 2, 4):
        c = torch.randint(0, 1 << bits, (7, 512), generator=gen)
        assert torch.equal(unpack_codes(pack_codes(c, bits), bits), c)
