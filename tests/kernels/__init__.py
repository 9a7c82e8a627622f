"""Shared harness of the kernel tests.

Kernels run on ``DEVICE`` (decided once, in tests/conftest.py: compiled on CUDA, interpreted on
CPU). Test data is drawn from seeded CPU generators (the same numbers in both modes) and moved
to the device with ``to_dev``; references (``kernels.ref``) run on the same device, or, when a
reference is a float64 loop on the CPU, are moved there before the comparison (``close``).

``TOL`` is the one table of tolerances: a kernel's output against its torch reference computed
from the same (rounded) inputs, by the dtype of the inputs.
"""
import torch

from tests.conftest import DEVICE

TOL = {
    torch.float32: dict(rtol=1e-5, atol=2e-4),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}
DTYPES = tuple(TOL)


def to_dev(*tensors):
    """The tensors on DEVICE (one tensor -> one tensor)."""
    out = tuple(t.to(DEVICE) if torch.is_tensor(t) else t for t in tensors)
    return out[0] if len(out) == 1 else out


def close(got, want, dtype=torch.float32, **override):
    """assert_close with TOL[dtype] after moving ``want`` to got's device and dtype."""
    tol = {**TOL[dtype], **override}
    torch.testing.assert_close(got, want.to(got.device, got.dtype), **tol)
