"""Test-wide setup. Triton kernels run in Triton's interpreter on machines without a GPU;
the flag must be set before triton is first imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
