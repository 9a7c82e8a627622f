"""Shared by the C++ CPU kernels' tests: skip where a kernel cannot be built here, fail where
it should have been."""
import os

import pytest

from sparseserve.kernels.cpu_extension import has_toolchain


def require_built(ext_available: bool, what: str, env_var: str) -> None:
    """Skip when the kernel is switched off (`env_var=torch`, its documented fallback) or the
    machine cannot build it (no compiler, ninja or Python headers); fail when it could and
    the kernel still did not build (e.g. source that compiled only with AVX-512)."""
    if ext_available:
        return
    if os.environ.get(env_var, "").lower() == "torch":
        pytest.skip(f"the {what} is switched off ({env_var}=torch)")
    if has_toolchain():
        pytest.fail(f"the {what} did not build although a compiler, ninja and Python's "
                    "headers are here: see the warning logged by "
                    "sparseserve.kernels.cpu_extension")
    pytest.skip(f"the {what} does not build here (no compiler, ninja or Python headers)")
