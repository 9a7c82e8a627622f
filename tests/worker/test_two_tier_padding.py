"""The two-tier prefill graphs' padding rows (worker/two_tier_graphs.py): each layer writes its
outputs in place and zeroes the rows past the prompt, so a padded key is a zero row's at every
layer (finite: nothing for 0 * NaN in attention), over stale buffers and several buckets, with
the real rows equal to a run in a larger bucket."""
import dataclasses

import torch

from sparseserve.worker.two_tier_graphs import TwoTierPrefillGraphs
from tests.conftest import DEVICE
from tests.worker.test_two_tier_graphs import TOL, _llm, _steps


def _prompt_of_54(tiny_model_dirs):
    """An engine (kept alive by the caller), its runner with the fused ops forced, a 54-token
    slot-free prompt chunk of layers [0, 2) with no page kept resident, and its stream."""
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = _llm(path, 400, max_num_seqs=8)
    runner = llm.engine.runner
    runner.model.fused_ops = True
    out = _steps(runner, llm.engine.scheduler)[0]
    runner._apply_page_diffs(out.chunks)
    chunk = dataclasses.replace(out.chunks[3], resident_pages=0)
    return llm, runner, chunk, runner.model.embed(torch.tensor(chunk.token_ids, device=DEVICE))


def test_padding_stream_stays_zero(tiny_model_dirs):
    """After each layer the padding rows' stream and residual are zero (so their k / v are a
    zero row's at the next layer: finite, nothing for 0 * NaN in attention), the real rows
    equal to a run with a larger bucket."""
    llm, runner, chunk, h = _prompt_of_54(tiny_model_dirs)
    res = []
    for bucket in (64, 224):
        tt = TwoTierPrefillGraphs(runner, [bucket], capture=False)
        tt.capture()
        with torch.inference_mode():  # as the runner's steps
            res.append(tt.run(h, chunk, 0, 2))
        assert not tt.x[54:bucket].any() and not tt.residual[54:bucket].any()
        rows = set(tt.pad_idx.tolist())  # the padding rows and the scratch row past them
        assert rows >= set(range(54, bucket)) and min(rows) == 54 and max(rows) <= bucket
    torch.testing.assert_close(res[0], res[1], rtol=TOL, atol=TOL)


def test_padding_rows_zero_at_every_layer_over_stale_buffers(tiny_model_dirs):
    """Several buckets and stale stream / residual everywhere (as a larger bucket's run leaves
    above the next run's rows): a 54-token run in bucket 64 sees zero padding rows at every
    layer's input (each layer writes in place, then zeroes rows 54 ..), and its result equals
    a one-bucket run's."""
    llm, runner, chunk, h = _prompt_of_54(tiny_model_dirs)
    ref = TwoTierPrefillGraphs(runner, [224], capture=False)
    ref.capture()
    with torch.inference_mode():
        want = ref.run(h, chunk, 0, 2)
    tt = TwoTierPrefillGraphs(runner, [32, 64, 128], capture=False)
    tt.capture()
    tt.x.fill_(3.0)
    tt.residual.fill_(-2.0)
    seen, layer_body = [], tt._layer

    def spy(layer, b):
        seen.append((b, tt.x[54:b].abs().max().item(), tt.residual[54:b].abs().max().item()))
        layer_body(layer, b)

    tt._layer = spy
    with torch.inference_mode():
        got = tt.run(h, chunk, 0, 2)
    assert seen == [(64, 0.0, 0.0), (64, 0.0, 0.0)]
    assert not tt.x[54:64].any() and not tt.residual[54:64].any()
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
