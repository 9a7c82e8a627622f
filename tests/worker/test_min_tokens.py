"""min_tokens' stop-token mask in the sampler (worker/min_tokens.py): rows below min_tokens
never pick a stop token, other rows are untouched, and a row whose other tokens are all
forbidden (a grammar that allows only stop tokens) keeps them."""
import torch

from sparseserve.request import SamplingParams
from sparseserve.worker.min_tokens import mask_stop_tokens, stop_token_index
from sparseserve.worker.sampler import Sampler, SamplingBatch

V = 40


def test_masked_rows_avoid_stop_tokens_others_untouched():
    logits = torch.randn(3, V)
    logits[:, 7] = 50.0  # the argmax of every row
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.0)]
    batch = SamplingBatch(params, [0, 0, 5], stop_ids=[(7, 9), (7,), ()])
    for _ in range(20):
        toks = Sampler(torch.device("cpu"), 0)(logits, batch).token_ids.tolist()
        assert toks[0] not in (7, 9) and toks[1] != 7 and toks[2] == 7
    assert toks[0] == logits[0].masked_fill(torch.tensor([i in (7, 9) for i in range(V)]),
                                            float("-inf")).argmax()


def test_row_with_only_stop_tokens_allowed_keeps_them():
    x = torch.randn(2, V)
    x[0, :] = float("-inf")
    x[0, 2] = 1.0  # a grammar that allows only EOS (2)
    before = x.clone()
    mask_stop_tokens(x, stop_token_index([0, 1], [(2, 5), (2, V + 3)], V, x.device))
    assert torch.equal(x[0], before[0])  # nothing else was allowed: unchanged
    assert torch.isneginf(x[1, 2]) and x[1].isfinite().sum() == V - 1  # ids >= V are dropped


def test_logprobs_stay_raw():
    logits = torch.randn(1, V)
    out = Sampler(torch.device("cpu"), 0)(
        logits, SamplingBatch([SamplingParams(temperature=0.0, logprobs=1)], [0],
                              stop_ids=[(int(logits.argmax()),)]))
    assert out.sampled_rank[0] == 2  # the best (raw) token was masked
