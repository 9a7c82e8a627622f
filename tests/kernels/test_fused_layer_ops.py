"""Fused decoder-layer ops (kernels/fused_layer_ops.py) against their torch references
(kernels/ref_layer_ops.py, the model's own torch code paths), interpreted on CPU and compiled
on CUDA, at odd token counts, hidden sizes that are not powers of two, GQA and MHA layouts.

Bitwise: the residual add and the rotary embedding (all dtypes). Not bitwise, but equal in
all but a few elements per 10^3 (bf16/fp16): RMSNorm (the mean's summation order differs from
torch's: the normalised value, rounded to the dtype, can differ by 1 ulp) and silu_mul (exp:
libdevice's expf compiled, numpy's interpreted, vs torch's: silu can differ by 1 ulp). The
weight / up multiply that follows can turn 1 ulp into 2 (a relative change of up to 2^-7 in
bf16), so the outputs are held to 2 ulps. fp32 has no rounding to the storage dtype to hide
those: a few fp32 ulps.
"""
import pytest
import torch

from sparseserve.kernels import fused_layer_ops as K
from sparseserve.kernels import ref_layer_ops as R
from sparseserve.model.layers import RotaryEmbedding

from tests.conftest import DEVICE

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# max error in ulps of the dtype where the result is not bitwise (see the docstring)
NORM_ULPS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 8}
SILU_ULPS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 8}


def _mant(dtype):
    return {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]


def ulps(got, want):
    """Largest |got - want| in units in the last place (of want's dtype) of the larger of the two."""
    fi = torch.finfo(want.dtype)
    a, b = got.cpu().double(), want.cpu().double()
    m = torch.maximum(a.abs(), b.abs()).clamp_min(fi.tiny)
    ulp = torch.exp2(torch.floor(torch.log2(m)) - _mant(want.dtype))
    return ((a - b).abs() / ulp).max().item() if a.numel() else 0.0


def _gen(seed):
    return torch.Generator().manual_seed(seed)


CASES = [(T, N) for T in (1, 17, 54, 97) for N in (576, 4096)] + [(4097, 64), (4097, 200)]


@pytest.mark.parametrize("T,N", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_add_rms_norm(T, N, dtype, with_residual):
    g = _gen(T * 7 + N)
    x = (3 * torch.randn(T, N, generator=g)).to(dtype)
    r = torch.randn(T, N, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.2 * torch.randn(N, generator=g)).to(dtype)
    want, want_res = R.fused_add_rms_norm(x, r, w, 1e-5)
    got, got_res = K.fused_add_rms_norm(x.to(DEVICE), None if r is None else r.to(DEVICE),
                                        w.to(DEVICE), 1e-5)
    assert torch.equal(got_res.cpu(), want_res)  # the dtype add: bitwise
    assert got.dtype == dtype and got.shape == (T, N)
    assert ulps(got, want) <= NORM_ULPS[dtype]
    if dtype != torch.float32:  # the rounding to the dtype hides the mean's last bit: almost all equal
        assert (got.cpu() != want).float().mean().item() < 1e-3


@pytest.mark.parametrize("T,N", [(1, 576), (54, 4096), (4097, 200)])
def test_fused_add_rms_norm_residual_in_place(T, N):
    """``res_out=residual`` (the two-tier layer graphs' static stream): the new residual lands
    in the residual's own memory, bit for bit the out-of-place result, the normed rows too;
    ``res_out`` a row slice of a wider buffer leaves the rest of it alone."""
    g = _gen(T + N)
    x = (3 * torch.randn(T, N, generator=g)).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(T, N, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (1 + 0.2 * torch.randn(N, generator=g)).to(torch.bfloat16).to(DEVICE)
    want, want_res = K.fused_add_rms_norm(x, r, w, 1e-5)
    buf = torch.full((T + 3, N), 7.0, dtype=torch.bfloat16, device=DEVICE)
    buf[:T] = r
    ptr = buf.data_ptr()
    got, got_res = K.fused_add_rms_norm(x, buf[:T], w, 1e-5, res_out=buf[:T])
    assert got_res.data_ptr() == ptr and buf.data_ptr() == ptr
    assert torch.equal(buf[:T], want_res) and torch.equal(got, want)
    assert bool((buf[T:] == 7).all())
    with pytest.raises(AssertionError):  # a wrong-shaped output is refused
        K.fused_add_rms_norm(x, r, w, 1e-5, res_out=buf[:T + 1])
    with pytest.raises(ValueError, match="needs a residual"):  # nothing to write without one
        K.fused_add_rms_norm(x, None, w, 1e-5, res_out=buf[:T])


def test_gated_mlp_out_writes_the_down_projection():
    """``GatedMLP.forward(out=)`` writes what ``forward`` returns into ``out`` (the two-tier
    graphs' static stream) and refuses a residual with it."""
    from sparseserve.model.layers import GatedMLP
    torch.manual_seed(3)
    mlp = GatedMLP(64, 96).to(DEVICE)
    x = torch.randn(17, 64, device=DEVICE)
    with torch.inference_mode():  # as the engine runs (mm(out=) does not record grads)
        want = mlp(x, fused=True)
        out = torch.zeros(17, 64, device=DEVICE)
        got = mlp(x, fused=True, out=out)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match="out="):
            mlp(x, residual=x, fused=True, out=out)


def test_rms_norm_strided_rows_and_plain_wrapper():
    """Rows of a wider buffer (a strided view), and ``rms_norm`` == ``RMSNorm.forward``."""
    g = _gen(1)
    buf = torch.randn(9, 3 * 576, generator=g).to(torch.bfloat16)
    x = buf[:, 576:2 * 576]
    w = (1 + 0.2 * torch.randn(576, generator=g)).to(torch.bfloat16)
    want = R.rms_norm(x, w, 1e-6)
    got = K.rms_norm(buf.to(DEVICE)[:, 576:2 * 576], w.to(DEVICE), 1e-6)
    assert ulps(got, want) <= 2


ROPE_LAYOUTS = [(4, 2, 64), (4, 4, 128), (6, 2, 96), (32, 8, 128)]  # (Hq, Hkv, D): GQA, MHA


# 4097 tokens with the small layouts only (interpreted runs are slow)
ROPE_CASES = [(T, *lay) for T in (1, 17, 54, 97) for lay in ROPE_LAYOUTS] + [(4097, 4, 2, 64)]


@pytest.mark.parametrize("T,hq,hkv,d", ROPE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_qk_bitwise(T, hq, hkv, d, dtype):
    g = _gen(T + hq * d)
    rope = RotaryEmbedding(d, 8192, 500000.0, None)
    pos = torch.randint(0, 8192, (T,), generator=g)
    cos, sin = rope.cos_sin(pos)  # [T, 1, D] fp32 views of one [T, 2, D] gather
    qkv = (2 * torch.randn(T, hq + 2 * hkv, d, generator=g)).to(dtype)
    want = R.rotary_qk(qkv, cos, sin, hq, hkv)
    got = qkv.to(DEVICE)
    out = K.rotary_qk_(got, cos.to(DEVICE), sin.to(DEVICE), hq, hkv)
    assert out is got  # in place
    assert torch.equal(got.cpu(), want)  # v untouched, q and k bitwise


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_separate_q_and_k(dtype):
    """The path for unfused q/k projections: ``rotary_`` on a contiguous [T, H, D]."""
    g = _gen(5)
    rope = RotaryEmbedding(64, 512, 10000.0, dict(rope_type="llama3", factor=8.0,
                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=128))
    pos = torch.arange(17) * 29 % 512
    cos, sin = rope.cos_sin(pos)
    q = torch.randn(17, 5, 64, generator=g).to(dtype)
    want = R.rotary(q, cos, sin)
    got = K.rotary_(q.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE))
    assert torch.equal(got.cpu(), want)


SILU_CASES = [(T, I) for T in (1, 17, 54, 97) for I in (100, 1536)] + [(4097, 48)]


@pytest.mark.parametrize("T,I", SILU_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(T, I, dtype):
    g = _gen(T * 3 + I)
    gate_up = (4 * torch.randn(T, 2 * I, generator=g)).to(dtype)
    want = R.silu_mul(gate_up, I)
    got = K.silu_mul(gate_up.to(DEVICE), I)
    assert got.dtype == dtype and got.shape == (T, I)
    assert ulps(got, want) <= SILU_ULPS[dtype]
    if dtype != torch.float32:
        assert (got.cpu() != want).float().mean().item() < 1e-2


def test_kernels_leave_inputs_alone_and_take_empty_batches():
    x = torch.randn(3, 64).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(3, 64).to(torch.bfloat16).to(DEVICE)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    x0, r0 = x.clone(), r.clone()
    K.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    e = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    assert K.fused_add_rms_norm(e, e, w, 1e-5)[0].shape == (0, 64)
    assert K.silu_mul(torch.empty(0, 64, device=DEVICE), 32).shape == (0, 32)


@pytest.mark.gpu_only("CUDA graph capture")
def test_capturable_in_a_cuda_graph():
    g = _gen(3)
    T, N, I, hq, hkv, d = 4, 4096, 1536, 32, 8, 128
    x = torch.randn(T, N, generator=g).to(torch.bfloat16).cuda()
    r = torch.randn(T, N, generator=g).to(torch.bfloat16).cuda()
    w = torch.ones(N, dtype=torch.bfloat16, device="cuda")
    gu = torch.randn(T, 2 * I, generator=g).to(torch.bfloat16).cuda()
    qkv = torch.randn(T, hq + 2 * hkv, d, generator=g).to(torch.bfloat16).cuda()
    cos, sin = RotaryEmbedding(d, 64, 10000.0, None).cos_sin(torch.arange(T, device="cuda"))

    def step():
        return (K.fused_add_rms_norm(x, r, w, 1e-5), K.silu_mul(gu, I),
                K.rotary_qk_(qkv.clone(), cos, sin, hq, hkv))

    eager = step()  # also compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0][0], eager[0][0]) and torch.equal(out[0][1], eager[0][1])
    assert torch.equal(out[1], eager[1]) and torch.equal(out[2], eager[2])
