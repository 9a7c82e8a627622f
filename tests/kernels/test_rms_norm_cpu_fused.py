"""The fused C++ CPU add + RMSNorm (kernels/rms_norm_cpu_fused.py) against torch: the stream
(residual + x) bitwise, the normalised output within the fp32 tolerance of the Triton kernel's
tests (tests/kernels/test_fused_layer_ops.py: 8 ulps; only the sum of squares is summed in
another order than torch's, moving rstd by its last bit), at odd row counts and hidden sizes,
with and without the residual, on the AVX-512 path ("fused", where the machine has it) and
the scalar one ("generic"). Skipped without a compiler; a failed build with one fails."""
import pytest
import torch
import torch.nn.functional as F

from sparseserve.kernels import rms_norm_cpu_fused as K
from sparseserve.model import layers

from tests.kernels.cpu_build import require_built
from tests.kernels.test_fused_layer_ops import NORM_ULPS, ulps

PATHS = ["fused", "generic"]


@pytest.fixture(autouse=True)
def _built():
    require_built(K.available(), "fused CPU RMSNorm kernel", "SPARSESERVE_CPU_NORM")


def _inputs(T, N, seed):
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(T, N, generator=g)
    r = torch.randn(T, N, generator=g)
    w = 1 + 0.2 * torch.randn(N, generator=g)
    return x, r, w


@pytest.mark.parametrize("T", [1, 17, 54, 97])
@pytest.mark.parametrize("N", [64, 576, 100, 1])  # 100, 1: the masked tail / no full vector
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("path", PATHS)
def test_matches_torch(T, N, with_residual, path):
    x, r, w = _inputs(T, N, T * 31 + N)
    x0, r0 = x.clone(), r.clone()
    res = r if with_residual else None
    got, stream = K.add_rms_norm(x, res, w, 1e-5, generic=path == "generic")
    want_stream = r + x if with_residual else x
    want = F.rms_norm(want_stream, (N,), w, 1e-5)
    assert torch.equal(stream, want_stream)  # torch's residual + x, bitwise
    assert got.shape == (T, N) and got.dtype == torch.float32
    assert ulps(got, want) <= NORM_ULPS[torch.float32]
    # against the exact value (fp64): as close as torch's own result, up to the same few ulps
    exact = F.rms_norm(want_stream.double(), (N,), w.double(), 1e-5)
    assert ulps(got, exact.float()) <= NORM_ULPS[torch.float32]
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs not written
    if not with_residual:
        assert stream is x  # the stream is x itself, not a copy


@pytest.mark.parametrize("path", PATHS)
def test_eps_zero_rows_and_shapes(path):
    gen = path == "generic"
    _, _, w = _inputs(1, 576, 3)
    # eps is applied inside the root: a large eps moves every output
    x = torch.full((2, 576), 0.5)
    got, _ = K.add_rms_norm(x, None, w, 1.0, generic=gen)
    assert torch.allclose(got, 0.5 / (0.25 + 1.0) ** 0.5 * w, rtol=1e-6, atol=0)
    # an all-zero row stays zero (rsqrt(eps) is finite), its neighbours unaffected
    x, r, w = _inputs(3, 576, 4)
    x[1], r[1] = 1.0, -1.0
    got, stream = K.add_rms_norm(x, r, w, 1e-5, generic=gen)
    assert torch.equal(got[1], torch.zeros(576)) and torch.equal(stream[1], torch.zeros(576))
    assert ulps(got[[0, 2]], F.rms_norm((r + x)[[0, 2]], (576,), w, 1e-5)) <= 8
    # leading dims other than [T] and strided rows (a column slice of a wider buffer)
    x3, r3, _ = _inputs(6, 576, 5)
    x3, r3 = x3.view(2, 3, 576), r3.view(2, 3, 576)
    got, stream = K.add_rms_norm(x3, r3, w, 1e-5, generic=gen)
    assert got.shape == stream.shape == (2, 3, 576) and torch.equal(stream, r3 + x3)
    assert ulps(got, F.rms_norm(r3 + x3, (576,), w, 1e-5)) <= 8
    buf = torch.randn(5, 3 * 576)
    got, _ = K.add_rms_norm(buf[:, 576:1152], None, w, 1e-5, generic=gen)
    assert ulps(got, F.rms_norm(buf[:, 576:1152], (576,), w, 1e-5)) <= 8
    # no rows
    e = torch.empty(0, 64)
    got, stream = K.add_rms_norm(e, e, torch.ones(64), 1e-5, generic=gen)
    assert got.shape == stream.shape == (0, 64)


def test_many_rows_threads():
    """Rows split over threads (at::parallel_for) give the one-thread result bitwise."""
    x, r, w = _inputs(4097, 576, 6)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = K.add_rms_norm(x, r, w, 1e-5)
        torch.set_num_threads(max(2, n))
        many = K.add_rms_norm(x, r, w, 1e-5)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_rejects_bad_inputs():
    x, r, w = _inputs(2, 64, 7)
    with pytest.raises(RuntimeError):
        K.add_rms_norm(x, r, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError):
        K.add_rms_norm(x, r[:1], w, 1e-5)
    assert not K.usable(x.double(), w) and not K.usable(x, w.half())


def test_model_rms_norm_takes_it_on_cpu_fp32():
    """``model.layers.rms_norm`` (RMSNorm.forward): the kernel's output when enabled, exactly
    F.rms_norm when switched off; autograd inputs keep F.rms_norm (the kernel has no backward)."""
    x, _, w = _inputs(17, 576, 8)
    want_kernel = K.add_rms_norm(x, None, w, 1e-5)[0]
    assert torch.equal(layers.rms_norm(x, w, 1e-5), want_kernel)
    K.set_enabled(False)
    try:
        assert not K.usable(x, w)
        assert torch.equal(layers.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))
    finally:
        K.set_enabled(True)
    wg = w.clone().requires_grad_(True)
    out = layers.rms_norm(x, wg, 1e-5)
    out.sum().backward()  # F.rms_norm took it: the weight gets its gradient
    assert wg.grad is not None and torch.equal(out.detach(), F.rms_norm(x, (576,), w, 1e-5))
