"""What Triton would compile, seen on the CPU: the CUDA specialisation key of every launch that
runs in Triton's interpreter (TRITON_INTERPRET=1).

Why: on a GPU, Triton compiles one kernel per *specialisation* of its arguments — each
integer is classed as == 1, divisible by 16 or neither, each pointer as 16-byte aligned or
not, each constexpr by its value, each tensor by its dtype. A class first seen while serving
costs a compile (0.2-1 s) that some request waits for: the sparseserve preset's HTTP TTFT
stall on the H200 was ten such compiles of the retrieve kernels (docs/results/serving.md,
twentieth session). The start-up warm-up (engine/warmup.py) must therefore reach every class
serving reaches. On the CPU the interpreter compiles nothing, so this module computes the key
Triton's CUDA launcher would compute — with Triton's own `native_specialize_impl` and a CUDA
backend object (no GPU needed) — and records it per kernel. Tests run the engine's fused
paths in the interpreter under a `SpecialisationLog` and compare what the warm-up recorded
with what serving recorded.

The key: one entry per kernel parameter, as Triton's binder builds it (`("constexpr", value)`,
`("*i32", "D")` for an aligned int32 pointer, `("i32", "")` for an int that is neither 1 nor
a multiple of 16, ...), honouring the kernel's `do_not_specialize` and
`do_not_specialize_on_alignment`, plus the launch options (num_warps, num_stages).
"""
from __future__ import annotations

import inspect
from typing import Any


def _backend(capability: int):
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    return CUDABackend(GPUTarget("cuda", capability, 32))


def _names(values, params: list[str]) -> set[str]:
    """do_not_specialize entries are parameter names or indices."""
    return {params[v] if isinstance(v, int) else v for v in (values or [])}


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation  # a string under `from __future__ import annotations`
    return ann is not inspect.Parameter.empty and str(getattr(ann, "__name__", ann)).endswith(
        "constexpr")


def _specialise(backend, fn, kwargs_of_jit: dict, args: tuple,
                kwargs: dict) -> tuple[list[tuple[str, str, Any]], dict]:
    """Each parameter of one launch of `fn` as Triton's binder specialises it, honouring the
    kernel's do_not_specialize / do_not_specialize_on_alignment -> ([(name, kind, x)], launch
    options). kind: "constexpr" (a constexpr parameter, or an int specialised to its value,
    == 1) with its value as x, or the type ("*i32", "i64", ...) with the attribute as x ("D":
    divisible by 16 / 16-byte aligned, "": neither)."""
    from triton.runtime.jit import native_specialize_impl
    sig = inspect.signature(fn)
    params = list(sig.parameters)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    no_spec = _names(kwargs_of_jit.get("do_not_specialize"), params)
    no_align = _names(kwargs_of_jit.get("do_not_specialize_on_alignment"), params)
    entries = []
    for name, p in sig.parameters.items():
        value = bound.arguments[name]
        if _is_constexpr(p):
            entries.append((name, "constexpr", value))
            continue
        kind, attr = native_specialize_impl(backend, value, False, name not in no_spec,
                                            name not in no_align)
        entries.append((name, str(kind), value if kind == "constexpr" else attr))
    return entries, {k: v for k, v in kwargs.items() if k not in sig.parameters}


class SpecialisationLog:
    """Records {kernel name: set of specialisation keys} for Triton launches in the
    interpreter while installed. `install()` / `uninstall()` patch Triton's
    `InterpretedFunction.run`; use as a context manager. `mark()` snapshots what was seen so
    far; `new_since_mark()` -> {kernel: [keys first seen after the mark]}."""

    def __init__(self, capability: int = 90, execute: bool = True) -> None:
        """execute=False records each launch and skips it (outputs are left as they were):
        the keys of shapes far too large for the interpreter."""
        self.execute = execute
        self.keys: dict[str, set[tuple]] = {}
        self._marked: dict[str, set[tuple]] = {}
        self._backend = _backend(capability)
        self._orig = None

    def key(self, fn, kwargs_of_jit: dict, args: tuple, kwargs: dict) -> tuple:
        """The key for one launch of python function `fn` (the kernel before @triton.jit)."""
        entries, options = _specialise(self._backend, fn, kwargs_of_jit, args, kwargs)
        return tuple((name, kind, repr(x) if kind == "constexpr" else str(x))
                     for name, kind, x in entries) + tuple(sorted(options.items()))

    def _record(self, interpreted, args: tuple, kwargs: dict) -> None:
        key = self.key(interpreted.fn, interpreted.kwargs, args, kwargs)
        self.keys.setdefault(interpreted.fn.__name__, set()).add(key)

    def install(self) -> "SpecialisationLog":
        from triton.runtime.interpreter import InterpretedFunction
        if self._orig is not None:
            return self
        orig = self._orig = InterpretedFunction.run
        log = self

        def run(self, *args: Any, grid, warmup, **kwargs: Any):
            log._record(self, args, kwargs)
            if log.execute:
                return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        InterpretedFunction.run = run
        return self

    def uninstall(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction
        if self._orig is not None:
            InterpretedFunction.run = self._orig
            self._orig = None

    def __enter__(self) -> "SpecialisationLog":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def mark(self) -> None:
        self._marked = {k: set(v) for k, v in self.keys.items()}

    def new_since_mark(self) -> dict[str, list[tuple]]:
        return {k: sorted(v - self._marked.get(k, set())) for k, v in self.keys.items()
                if v - self._marked.get(k, set())}


def describe_difference(new: tuple, seen: set[tuple]) -> str:
    """The parameters in which `new` differs from the closest key in `seen` (for a failure
    message: 'fresh_ptr: *i1 (was *i32), N: i32 "" (was "D")')."""
    if not seen:
        return "no launch of this kernel before"
    best = min(seen, key=lambda k: sum(a != b for a, b in zip(k, new)))
    return ", ".join(f"{a[0]}: {' '.join(map(str, a[1:]))} (was {' '.join(map(str, b[1:]))})"
                     for a, b in zip(new, best) if a != b)


def compile_spec(interpreted, args: tuple, kwargs: dict, capability: int = 90) -> dict:
    """What Triton would compile for one interpreted launch on a GPU, as plain data (JSON):
    the kernel's module and name, its signature, constexpr values, specialisation attributes
    and launch options. compile_for_cuda compiles it in a process where Triton is not in
    interpreter mode (there the kernel and the helpers it calls are JIT functions)."""
    fn = interpreted.fn
    entries, options = _specialise(_backend(capability), fn, interpreted.kwargs, args, kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, kind, x) in enumerate(entries):
        signature[name] = kind
        if kind == "constexpr":
            constexprs[str(i)] = x
        elif isinstance(x, str) and x:
            attrs[str(i)] = x
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature,
            "constexprs": constexprs, "attrs": attrs, "options": options}


def compile_for_cuda(spec: dict, capability: int = 90):
    """Compile a compile_spec for a CUDA target on any machine, no GPU needed (Triton's front
    end, its GPU passes and ptxas): catches what the interpreter, which runs kernels as
    Python, lets through — a loop-carried variable whose type changes, a block shape that is
    not a power of two, an op the GPU backend lacks. Needs Triton out of interpreter mode.
    -> Triton's CompiledKernel."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    backend = _backend(capability)
    constexprs = {(int(i),): v for i, v in spec["constexprs"].items()}
    attrs = {(int(i),): backend.parse_attr(a) for i, a in spec["attrs"].items()}
    src = ASTSource(kernel, spec["signature"], constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=spec["options"])


class LaunchRecorder(SpecialisationLog):
    """A SpecialisationLog that also keeps the compile_spec of each launch with a new key."""

    def __init__(self, capability: int = 90, execute: bool = True) -> None:
        super().__init__(capability, execute)
        self.specs: list[dict] = []

    def _record(self, interpreted, args: tuple, kwargs: dict) -> None:
        key = self.key(interpreted.fn, interpreted.kwargs, args, kwargs)
        seen = self.keys.setdefault(interpreted.fn.__name__, set())
        if key not in seen:
            seen.add(key)
            self.specs.append(compile_spec(interpreted, args, kwargs))


if __name__ == "__main__":  # compile specs given as JSON on stdin (a process out of the
    import json             # interpreter): prints each kernel's name and its PTX size
    import sys

    for spec in json.load(sys.stdin):
        kernel = compile_for_cuda(spec)
        print(spec["name"], len(kernel.asm["ptx"]), "cubin" in kernel.asm)
