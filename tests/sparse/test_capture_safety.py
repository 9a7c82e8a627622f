"""Every sparse algorithm's ``index`` and ``select`` are capturable in a CUDA graph: they copy no
host tensor to the device and never synchronise with the host.

A captured decode step indexes the pages it fills and selects; CUDA-graph capture refuses a
copy from an unpinned CPU tensor (``Cannot copy between CPU and CUDA tensors during CUDA graph
capture unless the CPU tensor is pinned``) and any host synchronisation. Without a GPU the
copies cannot be observed directly, so this holds the algorithm code (and the Python wrappers
of the kernels it calls, run in Triton's interpreter) to the patterns that cause them:

* ``t[index_tensor] = 0.5`` — on a CUDA ``t`` the Python scalar becomes a CPU tensor that
  ``index_put_`` copies to the device (keycode2-sparq's ``wsum[rows] = -1.0`` failed both
  graph tests on the H200 this way; ``index_fill_`` / ``masked_fill_`` take the scalar as a
  kernel argument);
* a list used as an index (a CPU index tensor, copied);
* ``torch.tensor`` / ``as_tensor`` / ``from_numpy`` (host data, copied when put on the device);
* ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()`` (host synchronisations).

Only calls made directly from sparseserve code count (Triton's interpreter does all of these).
Plus a source check of the same setitem pattern over sparseserve/sparse/.
"""
import ast
import os
import sys

import pytest
import torch

import sparseserve.kernels as kernels
from sparseserve.sparse import available_algorithms, get_algorithm_class
from tests.conftest import DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALGOS = [a for a in available_algorithms() if a != "dense"]


def _from_sparseserve(depth=2) -> bool:
    mod = sys._getframe(depth).f_globals.get("__name__", "")
    return mod.startswith("sparseserve")


def _has_index_tensor(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype != torch.bool and i.dim() > 0
               for i in items)


def _has_list(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, list) for i in items)


class HostTraffic:
    """Records the host-copy / host-sync patterns above while active (module docstring)."""

    def __init__(self, monkeypatch):
        self.seen = []
        self.active = False
        mp = monkeypatch
        setitem, getitem = torch.Tensor.__setitem__, torch.Tensor.__getitem__

        def guarded_setitem(t, idx, value):
            if self.active and _from_sparseserve():
                if isinstance(value, (int, float, bool)) and _has_index_tensor(idx):
                    self.note(f"tensor[index tensor] = {value!r} (index_put_ of a CPU scalar)")
                if _has_list(idx):
                    self.note("a list as an index")
            return setitem(t, idx, value)

        def guarded_getitem(t, idx):
            if self.active and _has_list(idx) and _from_sparseserve():
                self.note("a list as an index")
            return getitem(t, idx)

        mp.setattr(torch.Tensor, "__setitem__", guarded_setitem)
        mp.setattr(torch.Tensor, "__getitem__", guarded_getitem)
        for name in ("tensor", "as_tensor", "from_numpy"):
            mp.setattr(torch, name, self._wrap(getattr(torch, name), f"torch.{name}"))
        for name in ("item", "tolist", "cpu", "numpy"):
            mp.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name),
                                                      f"Tensor.{name}"))

    def _wrap(self, fn, what):
        def wrapped(*a, **k):
            if self.active and _from_sparseserve():
                self.note(what)
            return fn(*a, **k)
        return wrapped

    def note(self, what):
        f = sys._getframe(2)  # note <- the guard <- the caller
        self.seen.append(f"{what} at {os.path.relpath(f.f_code.co_filename, ROOT)}:{f.f_lineno}")


def _run(algo, traffic, dtype=torch.float32):
    torch.manual_seed(0)
    B, hkv, G, D, ps, W = 2, 2, 2, 16, 16, 12
    a = get_algorithm_class(algo)(ps, 6, 1, 1)
    P = B * W * hkv + 1
    k_cache = torch.randn(P, ps, D).to(dtype)
    v_cache = torch.randn(P, ps, D).to(dtype)
    summaries = a.make_summaries(P, D, dtype=dtype)
    page_table = torch.randperm(P - 1)[:B * hkv * W].view(B, hkv, W).int()
    n_pages = torch.tensor([5, 12], dtype=torch.int32)[:, None].expand(B, hkv).contiguous()
    last_len = torch.tensor([3, 16], dtype=torch.int32)
    ids = page_table.reshape(-1).clone()
    ids[-3:] = -1  # masked lanes, as a decode step's fill list has
    ntok = torch.full(ids.shape, ps, dtype=torch.int32)
    queries = torch.randn(ids.numel(), G, D).to(dtype)
    q = torch.randn(B, hkv * G, D).to(dtype)
    extra = {"v_cache": v_cache} if a.uses_values else {}
    dev = lambda t: t.to(DEVICE)  # noqa: E731 - compiled kernels on a GPU, interpreted here
    k_cache, v_cache, page_table, n_pages, last_len, ids, ntok, queries, q = map(
        dev, (k_cache, v_cache, page_table, n_pages, last_len, ids, ntok, queries, q))
    summaries.tensors = {name: dev(t) for name, t in summaries.tensors.items()}
    extra = {"v_cache": v_cache} if a.uses_values else {}
    traffic.active = True
    try:
        a.index(k_cache, ids, ntok, summaries, queries if a.uses_queries else None, **extra)
        sel = a.select(q, page_table, n_pages, last_len, summaries, k_cache)
        if a.estimates:
            a.estimate(q, sel, page_table, n_pages, summaries, D ** -0.5)
    finally:
        traffic.active = False
    return sel


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("algo", ALGOS)
def test_index_and_select_make_no_host_copy_nor_sync(algo, backend, monkeypatch):
    """``triton``: the kernels' Triton wrappers (what runs on the GPU; in the interpreter on a
    machine without one)."""
    if backend == "triton":
        orig = kernels.resolve_backend
        monkeypatch.setattr(kernels, "resolve_backend",
                            lambda b, t: orig("triton" if b in (None, "auto") else b, t))
    traffic = HostTraffic(monkeypatch)
    _run(algo, traffic)
    assert not traffic.seen, "\n".join(sorted(set(traffic.seen)))


def test_the_guard_sees_the_capture_failure_pattern(monkeypatch):
    """The pattern that broke keycode2-sparq's graphs is caught (and index_fill_ is not)."""
    traffic = HostTraffic(monkeypatch)
    t, rows = torch.zeros(4, 3), torch.tensor([0, 2])
    from sparseserve.kernels import ref  # any sparseserve module: run the lines "from" it
    code = compile("t[rows] = -1.0\nt.index_fill_(0, rows, -1.0)\nt[[1]]\n", "x", "exec")
    traffic.active = True
    exec(code, {"__name__": ref.__name__, "t": t, "rows": rows})
    traffic.active = False
    assert len(traffic.seen) == 2 and "index_put_" in traffic.seen[0]
    assert "list" in traffic.seen[1]


def _scalar_index_assignments(path):
    """(line, source) of ``x[<not a constant or slice>] = <number>`` in a module."""
    tree = ast.parse(open(path).read())
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        v = node.value
        if isinstance(v, ast.UnaryOp):
            v = v.operand
        if not (isinstance(v, ast.Constant) and isinstance(v.value, (int, float))):
            continue
        for tgt in node.targets:
            if isinstance(tgt, ast.Subscript):
                parts = tgt.slice.elts if isinstance(tgt.slice, ast.Tuple) else [tgt.slice]
                if any(not isinstance(p, (ast.Constant, ast.Slice)) for p in parts):
                    out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_python_scalar_assigned_through_an_index():
    """Source check: no ``x[idx] = number`` with a computed index in the algorithms (an index
    tensor on a CUDA ``x`` makes it a host copy; module docstring). An integer variable as the
    index would be harmless but cannot be told apart here: write ``index_fill_`` /
    ``masked_fill_`` / ``x[i].fill_(v)``."""
    package = "sparse"
    d = os.path.join(ROOT, "sparseserve", package)
    found = []
    for name in sorted(os.listdir(d)):
        if name.endswith(".py"):
            found += [f"{package}/{name}:{ln}: {src}"
                      for ln, src in _scalar_index_assignments(os.path.join(d, name))]
    assert not found, "\n".join(found)
