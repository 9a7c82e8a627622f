"""Piecewise graphs (worker/piecewise_graphs.py): the layers' attention-free pieces over static,
bucket-padded buffers with attention run between them must equal `run_layers` on the fused
path — token counts at and between buckets (1, 17, 54, 97), layer ranges that start and end
mid-model (layer segments), GQA and MHA; a context whose k / v are read after attention
returns gets copies the next piece cannot overwrite. Through the engine: the same tokens
as the op-by-op path with chunked prefill + decode rows (hybrid steps), and with the
sparseserve preset's layer segments over the two-tier cache. On CPU tensors the pieces run
uncaptured (Triton's interpreter for the fused kernels); on a GPU they are captured."""
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.worker.piecewise_graphs import PiecewiseGraphs, token_buckets

from tests.conftest import DEVICE
from tests.model.test_fused_model_path import CachedCausal, tiny_model


def test_token_buckets():
    assert token_buckets(2048)[-1] == 2048 and token_buckets(2048)[0] == 16
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    b = token_buckets(4096)
    assert b == sorted(set(b))


class KeepingCausal(CachedCausal):
    """CachedCausal that keeps the k / v tensors it was given, uncopied, as a side-stream
    saver would read them later; `reads_kv_after_attention` as the two-tier context says."""

    def __init__(self, reads_later: bool):
        super().__init__()
        self.reads_kv_after_attention = reads_later
        self.given = []

    def attention(self, layer, q, k, v):
        self.given.append((layer, k, v, k.clone(), v.clone()))
        return super().attention(layer, q, k, v)


def _pieces(model, buckets):
    return PiecewiseGraphs(model, buckets, capture=DEVICE == "cuda")


@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_equals_run_layers(kv_heads, dtype):
    model, cfg = tiny_model(dtype, kv_heads)
    model.fused_ops = True
    pw = _pieces(model, [16, 64, 128])
    pw.capture()
    L = model.num_layers
    # fp32: the CPU's GEMMs give the same rows for any row count; a GPU GEMM over the padded
    # bucket may reduce in another order (vLLM's padded graphs accept the same)
    fp32 = 1e-5 if DEVICE.type == "cpu" else 2e-4
    tol = dict(rtol=fp32, atol=fp32) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    with torch.inference_mode():
        for n, ranges in [(1, [(0, L)]), (17, [(0, 1), (1, L)]), (54, [(1, 2)]),
                          (97, [(0, 2), (2, L)]), (128, [(0, L)])]:
            ids = (torch.arange(n, device=DEVICE) * 7 + n) % cfg.vocab_size
            pos = torch.arange(128 - n, 128, device=DEVICE)  # table: 128 positions
            want_ctx, got_ctx = CachedCausal(), CachedCausal()
            h_want = h_got = model.embed(ids)
            for a, b in ranges:
                h_want = model.run_layers(h_want, pos, want_ctx, a, b)
                h_got = pw.run(h_got, pos, got_ctx, a, b)
            assert h_got.shape == h_want.shape and h_got.data_ptr() != pw.x.data_ptr()
            torch.testing.assert_close(h_got, h_want, **tol)
            for layer in want_ctx.k:  # attention saw the same K / V
                torch.testing.assert_close(got_ctx.k[layer], want_ctx.k[layer], **tol)


def test_kv_read_after_attention_is_a_copy():
    """A context that reads k / v after attention returns (a side-stream saver) must still see
    each layer's own k / v once later pieces have run; one that does not gets views."""
    model, cfg = tiny_model(torch.float32)
    model.fused_ops = True
    pw = _pieces(model, [32])
    pw.capture()
    ids = torch.arange(20, device=DEVICE) % cfg.vocab_size
    pos = torch.arange(20, device=DEVICE)
    with torch.inference_mode():
        for reads_later in (True, False):
            ctx = KeepingCausal(reads_later)
            pw.run(model.embed(ids), pos, ctx, 0, model.num_layers)
            for layer, k, v, k0, v0 in ctx.given:
                if reads_later:
                    assert torch.equal(k, k0) and torch.equal(v, v0), layer
            if not reads_later:  # views of the static buffer: later layers overwrote them
                _, k, v, k0, v0 = ctx.given[0]
                assert not torch.equal(k, k0) and not torch.equal(v, v0)


def test_runs_whole_step():
    """Hybrid steps that fit the largest bucket run whole through the pieces (vLLM's
    FULL_AND_PIECEWISE); decode-only steps keep their full graph; larger ones split."""
    model, _ = tiny_model(torch.float32)
    pw = _pieces(model, [16, 64])
    assert pw.runs_whole_step(2, 3, 40) and pw.runs_whole_step(0, 1, 64)
    assert not pw.runs_whole_step(3, 3, 3)  # decode only
    assert not pw.runs_whole_step(2, 3, 65)  # past the largest bucket
    assert not pw.runs_whole_step(2, 3, 40, segmented=True)  # a layer segment beside them
    assert not pw.runs_whole_step(2, 3, 40, sparse_decode=True)  # their graph is cheaper


def test_too_many_tokens_is_an_error():
    model, cfg = tiny_model(torch.float32)
    model.fused_ops = True
    pw = _pieces(model, [16])
    with torch.inference_mode(), pytest.raises(ValueError, match="largest piecewise bucket"):
        pw.run(torch.zeros(17, cfg.hidden_size, device=DEVICE),
               torch.arange(17, device=DEVICE), CachedCausal(), 0, 1)


LENS = (1, 17, 54, 97, 33, 5)


def _generate(path, piecewise, **kw):
    kw.setdefault("kv_cache_memory_bytes", 1 << 24)
    kw.setdefault("cudagraph_mode", "FULL_DECODE_ONLY")  # (the GPU's default FULL: no pieces)
    llm = LLM(path, device=DEVICE.type, dtype="float32", page_size=16, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=40, **kw)
    runner = llm.engine.runner
    runner.model.fused_ops = True  # the path piecewise graphs run (compiled on a GPU)
    if piecewise:
        runner.piecewise = _pieces(runner.model, token_buckets(40))
        runner.piecewise.capture()
    calls = []
    if piecewise:
        run = runner.piecewise.run
        runner.piecewise.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    prompts = [{"prompt_token_ids": [3 + (j * (i + 7)) % 300 for j in range(n)]}
               for i, n in enumerate(LENS)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_invariants()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls


@pytest.mark.parametrize("preset", ["dense", "sparse", "sparseserve"])
def test_engine_tokens_equal_eager(tiny_model_dirs, preset):
    """Chunked prefill beside decode rows (dense; sparse decode over HBM pages), layer
    segments over the two-tier cache with a device cache smaller than the batch
    (sparseserve): piecewise == op by op, tokens and their logprobs."""
    path, _ = tiny_model_dirs["llama-gqa"]
    kw = {}
    if preset == "sparse":
        kw = dict(preset="sparse", token_budget=64, sink_pages=1, local_pages=1)
    if preset == "sparseserve":
        page_bytes = 2 * 3 * 16 * 16 * 4
        kw = dict(preset="sparseserve", token_budget=64, sink_pages=1, local_pages=1,
                  kv_cache_memory_bytes=40 * page_bytes,
                  kv_offloading_size=400 * page_bytes / 2**30)
    want, _ = _generate(path, False, **kw)
    got, calls = _generate(path, True, **kw)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp_got), (_, lp_want) in zip(got, want):
        for g, w in zip(lp_got, lp_want):  # per token {id: Logprob}: same ids, close values
            assert g.keys() == w.keys()
            for tok in g:
                assert abs(g[tok].logprob - w[tok].logprob) < 1e-4
    assert calls and max(calls) <= 40  # steps with prefill work went through the pieces


@pytest.mark.skipif(DEVICE.type != "cuda", reason="captures CUDA graphs")
def test_engine_captures_pieces_on_gpu(tiny_model_dirs):
    """`cudagraph_mode=FULL_AND_PIECEWISE`: every piece of every bucket captured at start-up,
    steps with prefill work replay them, tokens == FULL_DECODE_ONLY's."""
    path, _ = tiny_model_dirs["llama-gqa"]
    prompts = [{"prompt_token_ids": [3 + (j * (i + 7)) % 300 for j in range(n)]}
               for i, n in enumerate(LENS)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = {}
    for mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        llm = LLM(path, device="cuda", dtype="float32", page_size=16, max_model_len=256,
                  max_num_seqs=4, max_num_batched_tokens=40, cudagraph_mode=mode,
                  kv_cache_memory_bytes=1 << 24)
        pw = llm.engine.runner.piecewise
        if mode == "FULL_DECODE_ONLY":
            assert pw is None
        else:
            L = llm.engine.runner.num_layers
            assert pw is not None and pw.buckets == token_buckets(40)
            assert len(pw.graphs) == (3 * L - 1) * len(pw.buckets)
        seen = []
        if pw is not None:  # which steps went through the pieces, with how many decode rows
            run = pw.run
            pw.run = lambda h, pos, ctx, a, b: seen.append((h.shape[0], ctx.num_decode)) or \
                run(h, pos, ctx, a, b)
        out[mode] = [o.outputs[0].token_ids
                     for o in llm.generate(prompts, params, use_tqdm=False)]
        if pw is not None:  # hybrid steps ran whole: decode rows beside prefill rows
            assert any(0 < nd < t for t, nd in seen)
        llm.engine.check_invariants()
        del llm
    assert out["FULL_AND_PIECEWISE"] == out["FULL_DECODE_ONLY"]
