"""On a GPU the sampler builds each new batch composition's parameter tensors (temperatures,
top-k/p, min-p, penalty rows and values, logit_bias, min_tokens' stop tokens) and scatters the
penalty state's tokens without a host sync: torch's sync debug mode raises on any
synchronizing copy made inside a step. The greedy rows, penalised or not, match the same
sampler on the CPU over several steps."""
from contextlib import contextmanager

import numpy as np

import pytest
import torch

from sparseserve.request import SamplingParams
from sparseserve.worker.sampler import Sampler, SamplingBatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

V = 64
PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.7,
                   presence_penalty=0.3, logit_bias={3: 2.0, 9: -4.0}, logprobs=2),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=11),
    SamplingParams(temperature=1.0, min_p=0.1, logit_bias={5: 1.5}, presence_penalty=1.0),
]
ROWS = [0, 2, 3, 5]
PROMPTS = [[1, 2, 3], [4, 4, 9, 3], [7], [5, 6]]
STOP = [(), (8,), (), (1, 2)]  # stop ids of the rows below their min_tokens at step 0


@contextmanager
def no_host_sync(device: torch.device):
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def sample(device: torch.device, steps: int) -> torch.Tensor:
    """[steps, N] tokens; each step feeds the last tokens, and the min_tokens rows change
    after step 0, so steps 0 and 1 each build a new composition's tensors."""
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(len(PARAMS), V, generator=gen).to(device) for _ in range(steps)]
    sampler = Sampler(device, seed=0, max_rows=8)
    tokens: list[list[int]] = []
    for step in range(steps):
        fed = [(r, f"req{i}", PROMPTS[i] if step == 0 else [tokens[-1][i]])
               for i, r in enumerate(ROWS) if PARAMS[i].has_penalties]
        batch = SamplingBatch(params=list(PARAMS), num_output_tokens=[step] * len(PARAMS),
                              rows=list(ROWS), stop_ids=list(STOP) if step == 0 else None)
        with no_host_sync(device):
            sampler.feed(fed, V)
            out = sampler(logits[step], batch)
        tokens.append(out.token_ids.tolist())  # the step's one host sync, as in the runner
    assert sampler.tensors.builds == min(steps, 2)
    return torch.tensor(tokens)


def test_new_compositions_sample_without_a_host_sync():
    gpu = sample(torch.device("cuda"), steps=4)
    cpu = sample(torch.device("cpu"), steps=4)
    greedy = [i for i, p in enumerate(PARAMS) if p.greedy]
    assert torch.equal(gpu[:, greedy], cpu[:, greedy])


@pytest.mark.parametrize("values,dtype", [
    ([1, 5, 2], None),
    ((0.5, 1.0, 2.0), torch.float32),
    ([], torch.long),
    (np.array([0, 0, 1, 3, 3], dtype=np.int64), torch.int64),
])
def test_to_device_on_cuda_takes_every_host_sequence(values, dtype):
    """Lists, tuples, empty lists and numpy arrays (prefill's page lists) all reach the GPU
    pinned and non-blocking, with torch.tensor's values and dtype."""
    from sparseserve.worker.host_copy import to_device
    device = torch.device("cuda")
    with no_host_sync(device):
        got = to_device(values, dtype, device)
    want = torch.tensor(values, dtype=dtype)
    assert got.device.type == "cuda" and got.dtype == want.dtype
    assert torch.equal(got.cpu(), want)
