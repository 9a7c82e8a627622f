"""The kernel-test harness itself (tests/conftest.py, tests/kernels/__init__.py): one device for
the whole session, kernels compiled on CUDA and interpreted on CPU (never interpreted on a GPU),
tolerances for every dtype, and the rule that no both-modes test skips silently on a GPU."""
import importlib
import os

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from tests.conftest import DEVICE, silent_gpu_skip
from tests.kernels import DTYPES, TOL, close, to_dev

KERNEL_MODULES = ["sparseserve.kernels.page_scores", "sparseserve.kernels.page_select",
                  "sparseserve.kernels.page_summary", "sparseserve.kernels.paged_decode",
                  "sparseserve.kernels.residency_hash", "sparseserve.kernels.retrieve",
                  "sparseserve.kernels.slot_store", "sparseserve.transfer.flash_h2d",
                  "sparseserve.transfer.gpu_direct"]


def test_device_is_cuda_exactly_when_a_gpu_is_present(device):
    assert device == DEVICE
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    assert interpret is (device.type == "cpu")


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_kernels_are_interpreted_exactly_on_cpu(device, name):
    """Every @triton.jit function of the module is an InterpretedFunction on CPU and a
    compiled JITFunction on CUDA (the interpreter setting does not leak into GPU runs)."""
    import triton

    mod = importlib.import_module(name)
    kernels = [v for v in vars(mod).values()
               if isinstance(v, (triton.runtime.JITFunction, InterpretedFunction))]
    assert kernels, f"no Triton kernel found in {name}"
    for k in kernels:
        assert isinstance(k, InterpretedFunction) is (device.type == "cpu"), (name, k)


def test_to_dev_and_close_move_to_the_device(device):
    a, b = to_dev(torch.ones(3), torch.zeros(2, dtype=torch.int32))
    assert a.device.type == b.device.type == device.type
    assert to_dev(torch.ones(1)).device.type == device.type   # one tensor in, one out
    close(a, torch.ones(3))                                    # the CPU reference travels
    with pytest.raises(AssertionError):
        close(a, torch.full((3,), 1.01))


def test_tolerances_cover_every_dtype_and_grow_with_rounding():
    assert set(DTYPES) == {torch.float32, torch.float16, torch.bfloat16}
    eps = {dt: torch.finfo(dt).eps for dt in DTYPES}
    for dt in DTYPES:
        assert TOL[dt]["rtol"] >= eps[dt] and TOL[dt]["atol"] > 0   # at least one ulp
    assert TOL[torch.float32]["rtol"] < TOL[torch.float16]["rtol"] < TOL[torch.bfloat16]["rtol"]


def test_silent_skips_fail_only_on_gpu_in_both_mode_dirs():
    kern = "tests/kernels/test_x.py::test_a"
    assert silent_gpu_skip(kern, cpu_only=False, gpu=True)
    assert silent_gpu_skip("tests/transfer/test_x.py::test_a", cpu_only=False, gpu=True)
    assert not silent_gpu_skip(kern, cpu_only=True, gpu=True)     # marked with a reason
    assert not silent_gpu_skip(kern, cpu_only=False, gpu=False)   # CPU: gpu_only skips are fine
    assert not silent_gpu_skip("tests/server/test_x.py::test_a", cpu_only=False, gpu=True)


def test_marks_without_a_reason_are_refused(pytestconfig):
    from tests.conftest import _reason

    class Item:
        nodeid = "tests/kernels/test_x.py::test_a"

        def __init__(self, mark):
            self.mark = mark

        def get_closest_marker(self, name):
            return self.mark if name == "cpu_only" else None

    assert _reason(Item(pytest.mark.cpu_only("why").mark), "cpu_only") == "why"
    assert _reason(Item(None), "cpu_only") is None
    with pytest.raises(pytest.UsageError):
        _reason(Item(pytest.mark.cpu_only.mark), "cpu_only")
