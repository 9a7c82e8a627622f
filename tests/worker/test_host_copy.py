"""host_copy.to_device: the values and dtypes torch.tensor would give, from lists, tuples,
numpy arrays and empty sequences; a sampler step sends every host list through it. (That the
CUDA path makes no host sync is checked on a GPU by tests/gpu/test_sampler_no_sync.py.)"""
import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from sparseserve.request import SamplingParams
from sparseserve.worker.host_copy import pack_to_device, to_device
from sparseserve.worker.penalties import apply_logit_bias
from sparseserve.worker.sampler import Sampler, SamplingBatch


@pytest.mark.parametrize("values,dtype", [
    ([1, 5, 2], None),
    ([True, False, True], None),
    ((0.5, 1.0, 2.0), torch.float32),
    ([0.25, -3.0], torch.bfloat16),
    ([3, 4], torch.long),
    ([], torch.long),
    (np.array([7, 8, 9], dtype=np.int64), torch.long),
])
def test_same_tensor_as_torch_tensor(values, dtype):
    got = to_device(values, dtype, torch.device("cpu"))
    want = torch.tensor(values, dtype=dtype)
    assert got.device.type == "cpu" and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("sizes", [(0, 1), (1, 3), (3, 5), (2, 17), (5, 0)])
def test_packed_arrays_round_trip_each_16_byte_aligned(sizes):
    """pack_to_device: every array keeps its values, dtype and shape, and starts at a
    16-byte boundary whatever the sizes before it (Triton specialises on that alignment: an
    offset that moved with the sizes compiled new kernel variants mid-serving)."""
    n64, n32 = sizes
    rng = np.random.default_rng(n64 * 10 + n32)
    p64 = {"a": rng.integers(-2**40, 2**40, n64), "b": rng.integers(0, 9, (n32, 2))}
    p32 = {"c": rng.integers(-9, 9, n32).astype(np.int32), "d": np.arange(n64 + 1),
           "e": rng.integers(0, 5, (1, n32 + 2))}
    out = pack_to_device(p64, p32, torch.device("cpu"))
    for name, a in {**p64, **p32}.items():
        t = out[name]
        assert t.dtype == (torch.int64 if name in p64 else torch.int32)
        assert tuple(t.shape) == a.shape and t.tolist() == a.tolist()
        assert t.data_ptr() % 16 == 0, (name, t.data_ptr() % 16)


def test_device_given_as_a_string():
    assert torch.equal(to_device([1, 2], torch.int32, "cpu"), torch.tensor([1, 2], dtype=torch.int32))


class DeviceBuilds(TorchFunctionMode):
    """Records each tensor built from host values straight on a device (`torch.tensor` /
    `torch.as_tensor` with a device): on a GPU that is a pageable copy that stalls the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            self.calls.append((func.__name__, args[0] if args else None, kwargs["device"]))
        return func(*args, **kwargs)


V = 48
PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.7,
                   presence_penalty=0.3, logit_bias={3: 2.0, 9: -4.0}, logprobs=2),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=11),
    SamplingParams(temperature=1.0, min_p=0.1, logit_bias={5: 1.5}, presence_penalty=1.0),
]
ROWS = [0, 2, 3, 5]
FED = [[1, 2, 3], [4, 4, 9, 3], [7], [5, 6]]  # rows 1 and 3 resume with 2 and 1 outputs
OUTPUTS = [0, 2, 0, 1]
STOP = [(), (8,), (), (1, 2)]  # rows below their min_tokens


def test_a_sampler_step_builds_device_tensors_only_through_to_device():
    """Every per-row parameter, penalty row, logit_bias entry, stop-token entry and fed token
    list of a new composition reaches the device through to_device (pinned, non-blocking on a
    GPU), none through torch.tensor(..., device=...)."""
    sampler = Sampler(torch.device("cpu"), seed=0, max_rows=8)
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(0))
    with DeviceBuilds() as mode:
        sampler.feed([(r, f"req{i}", FED[i]) for i, r in enumerate(ROWS)
                      if PARAMS[i].has_penalties], V)
        out = sampler(logits, SamplingBatch(params=list(PARAMS), num_output_tokens=list(OUTPUTS),
                                            rows=list(ROWS), stop_ids=list(STOP)))
        sampler.penalties.record([ROWS[1]], out.token_ids[1:2])  # without a device row index
        apply_logit_bias(logits.clone(), [SamplingParams(logit_bias={1: 1.0})])
    assert mode.calls == []
    assert sampler.tensors.builds == 1 and out.top_logprobs is not None
    assert out.token_ids[0] == logits[0].argmax()  # the plain greedy row is untouched
