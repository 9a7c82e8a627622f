"""gpu_direct_save with a capped grid (max_programs: each program loops over token blocks)
writes exactly what the uncapped grid and the torch reference write, bit for bit, at odd token
counts and across page edges; rows with page -1 and pages nobody saved keep their sentinel."""
import numpy as np
import pytest
import torch

from sparseserve.transfer.gpu_direct import _torch_save, gpu_direct_save

from . import DEV, PIN, batch_layout, filled, random_bits, same_bits, sync

SENTINEL = 0x3C3C
H, D, PS, P = 3, 32, 16, 1024


@pytest.mark.parametrize("T", [1, 17, 97, 4097])
@pytest.mark.parametrize("max_programs", [None, 1, 3, 7, 64])
def test_capped_grid_writes_what_the_reference_writes(T, max_programs):
    rng = np.random.default_rng(T)
    gen = torch.Generator().manual_seed(T)
    pages, offs, _ = batch_layout([5, 0], [T - T // 2, T // 2], H, PS, P, rng, pad=3)
    k = random_bits((pages.shape[0], H, D), torch.bfloat16, gen, device=DEV)
    v = random_bits((pages.shape[0], H, D), torch.bfloat16, gen, device=DEV)
    got = [filled((P, PS, D), torch.bfloat16, SENTINEL, pin=PIN) for _ in range(2)]
    want = [filled((P, PS, D), torch.bfloat16, SENTINEL) for _ in range(2)]
    p_dev = torch.from_numpy(pages).to(DEV)
    o_dev = torch.from_numpy(offs).to(DEV)[:, None].expand(-1, H)  # [T, H] (stride 0)
    gpu_direct_save(got[0], got[1], k, v, p_dev, o_dev, max_programs=max_programs)
    sync()
    _torch_save(want[0], want[1], k.cpu(), v.cpu(), torch.from_numpy(pages),
                torch.from_numpy(offs)[:, None])
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    assert (pages < 0).any()  # padding rows were in the batch and wrote nothing
