"""C++ CPU kernels built at first use (`torch.utils.cpp_extension.load_inline`, cached by torch
under ~/.cache/torch_extensions, one build per CPU capability), with the torch path as the
fallback: no g++ / ninja, missing headers, or the kernel switched off by its environment
variable (`NAME=torch`). Shared by the fused CPU decode attention and RMSNorm."""
from __future__ import annotations

import logging
import os
import shutil

import torch

log = logging.getLogger(__name__)


def has_toolchain() -> bool:
    """True when this machine can build an inline extension (a C++ compiler, ninja and
    Python's headers): a kernel that then fails to build is a bug in its source, not a
    missing tool."""
    import sysconfig

    from torch.utils.cpp_extension import is_ninja_available

    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    return (shutil.which(os.environ.get("CXX", "c++")) is not None and is_ninja_available()
            and headers)


class CpuExtension:
    """One inline C++ extension: `get()` -> the compiled module, or None (tried once)."""

    def __init__(self, name: str, source: str, functions: list[str], env_var: str,
                 what: str, extra_cflags: tuple[str, ...] = ()) -> None:
        self.name, self.source, self.functions = name, source, functions
        self.env_var, self.what, self.extra_cflags = env_var, what, extra_cflags
        self.module = None
        self.failed = False
        self.enabled = True  # set_enabled(False): callers take the torch path (A/B runs)

    def get(self):
        if self.module is not None or self.failed:
            return self.module
        if os.environ.get(self.env_var, "").lower() == "torch":
            self.failed = True
            return None
        try:
            from torch.utils.cpp_extension import load_inline
            log.info("loading the %s (compiled on first use, ~30 s; cached by torch)", self.what)
            cap = torch.backends.cpu.get_cpu_capability().lower()
            self.module = load_inline(
                name=f"{self.name}_{cap}", cpp_sources=[self.source], functions=self.functions,
                extra_cflags=["-O3", "-march=native", *self.extra_cflags, "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # no g++/ninja, headers missing, ...: the torch path stays
            log.warning("%s unavailable, using the torch path: %s", self.what, e)
            self.failed = True
        return self.module

    def set_enabled(self, on: bool) -> None:
        """Switch the kernel off (callers then take the torch path) or back on, in this
        process: for A/B measurements of the two paths in one engine."""
        self.enabled = bool(on)

    def available(self) -> bool:
        """True when the kernel is built (building it on the first call) and enabled."""
        return self.enabled and self.get() is not None

    def vectorised(self) -> bool:
        """True when the built kernel has a vector path here (AVX-512, or AVX2 + FMA where the
        kernel has one); False: only the scalar path."""
        return bool(self.vector_isa())

    def vector_isa(self) -> str:
        """The built kernel's vector path: "avx512", "avx2" or "" (scalar only / not built)."""
        if self.get() is None:
            return ""
        if hasattr(self.module, "vector_isa"):
            return str(self.module.vector_isa())
        return "avx512" if self.module.has_avx512() else ""
