"""On a GPU, kernels/compile_watch.py counts real Triton compilations (a new constexpr value
compiles once, a repeated launch does not), warns about them once armed, and a CUDA engine is
armed when its start-up warm-up is done."""
import logging

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _scale(x_ptr, n, BLOCK: tl.constexpr, FACTOR: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * FACTOR, mask=mask)


def test_real_compiles_are_counted_and_warned_about_once_armed(caplog):
    from sparseserve.kernels.compile_watch import CompileWatch

    w = CompileWatch()
    assert w.install()
    caplog.set_level(logging.WARNING, logger="sparseserve")
    try:
        x = torch.ones(97, device="cuda")
        _scale[(1,)](x, 97, BLOCK=128, FACTOR=3)
        torch.cuda.synchronize()
        assert w.compiles == 1 and w.seconds > 0
        w.arm()
        _scale[(1,)](x, 97, BLOCK=128, FACTOR=3)  # cached: no compile
        assert w.compiles == 1
        caplog.clear()
        _scale[(1,)](x, 97, BLOCK=128, FACTOR=5)  # a new specialisation while "serving"
        torch.cuda.synchronize()
        assert w.compiles == 2
        assert "_scale" in caplog.text and "while serving" in caplog.text
        assert torch.equal(x, torch.full_like(x, 45.0))  # 3 x 3 x 5: every launch ran
    finally:
        w.uninstall()


def test_a_cuda_engine_arms_the_watch_after_its_warm_up(tiny_model_dirs):
    from sparseserve import LLM
    from sparseserve.kernels.compile_watch import WATCH

    path, _ = tiny_model_dirs["llama-gqa"]
    llm = LLM(path, device="cuda", dtype="bfloat16", page_size=16, max_num_seqs=4,
              max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert WATCH.armed and WATCH._installed
    stats = llm.engine.get_stats()
    assert stats["triton_compiles_total"] == WATCH.compiles >= 0
