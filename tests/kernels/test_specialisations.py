"""kernels/specialisations.py computes the key Triton's CUDA launcher would compile for (under
the interpreter, on the CPU), and the kernels that run outside CUDA graphs keep one key per
real variant whatever the step's sizes: a new key mid-serving is a compile a request waits for.
"""
import torch
import triton
import triton.language as tl

import pytest

from sparseserve.kernels.paged_decode import MAX_SPLITS, paged_decode_attention
from sparseserve.kernels.specialisations import SpecialisationLog, describe_difference

from tests.kernels.test_paged_decode import _dense_attention, _paged

pytestmark = pytest.mark.cpu_only("records launches in Triton's interpreter")


@triton.jit(do_not_specialize=["n_free"], do_not_specialize_on_alignment=["y_ptr"])
def _copy_kernel(x_ptr, y_ptr, n, n_free, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n + 0 * n_free)


def _entry(log, name):
    (key,) = log.keys["_copy_kernel"]
    return next(e for e in key if e[0] == name)


@pytest.mark.parametrize("n, offset, n_class", [(1, 0, ("constexpr", "1")), (16, 1, ("i32", "D")),
                                                (17, 2, ("i32", ""))])
def test_keys_follow_tritons_rules(n, offset, n_class):
    """Integers: == 1 is a constant, % 16 == 0 'D', else ''; pointers 'D' when 16-byte
    aligned; do_not_specialize / do_not_specialize_on_alignment honoured; constexprs by value."""
    x = torch.arange(40, dtype=torch.float32)
    y = torch.zeros(40, dtype=torch.float32)
    with SpecialisationLog() as log:
        _copy_kernel[(1,)](x[offset:], y[offset:], n, 16, BLOCK=32)
    assert (_entry(log, "n")[1], _entry(log, "n")[2]) == n_class
    assert _entry(log, "x_ptr")[1:] == ("*fp32", "D" if offset % 4 == 0 else "")
    assert _entry(log, "y_ptr")[1:] == ("*fp32", "")  # never specialised on alignment
    assert _entry(log, "n_free")[1:] == ("i32", "None")  # 16, but not specialised
    assert _entry(log, "BLOCK") == ("BLOCK", "constexpr", "32")
    assert torch.equal(y[offset:offset + n], x[offset:offset + n])  # it still ran


def test_a_new_key_after_the_mark_is_reported_with_its_difference():
    x = torch.arange(40, dtype=torch.float32)
    with SpecialisationLog() as log:
        _copy_kernel[(1,)](x, x.clone(), 17, 3, BLOCK=32)
        log.mark()
        _copy_kernel[(1,)](x, x.clone(), 18, 3, BLOCK=32)  # same class as 17
        assert log.new_since_mark() == {}
        _copy_kernel[(1,)](x[1:], x.clone(), 32, 3, BLOCK=32)
        new = log.new_since_mark()
    assert list(new) == ["_copy_kernel"]
    text = describe_difference(new["_copy_kernel"][0], log._marked["_copy_kernel"])
    assert "x_ptr: *fp32  (was *fp32 D)" in text and "n: i32 D (was i32 )" in text


def test_eager_decode_compiles_one_kernel_per_split_mode():
    """Outside CUDA graphs the paged decode runs at the step's batch and widest row: batch
    1 to 5, widths of 1 to 40 pages, split counts 1 to many, page tables and page counts as
    slices at odd offsets (the engine's packed metadata) -> exactly one key per SPLIT mode
    for the decode kernel and one merge key; and the answers still match dense attention."""
    gen = torch.Generator().manual_seed(0)
    Hkv, G, D, ps = 2, 2, 16, 4
    with SpecialisationLog() as log:
        for lens, splits in [((1,), None), ((17, 3), None), ((97, 54, 1, 5, 30), None),
                             ((160,), 3), ((160, 40), 7), ((33,), MAX_SPLITS)]:
            ks, vs, kc, vc, table, num_pages, last = _paged(lens, Hkv, D, ps, gen)
            B, _, W = table.shape
            # the table and counts at an odd word offset of a larger buffer
            tbuf = torch.zeros(B * Hkv * W + 3, dtype=torch.int32)
            tbuf[3:] = table.reshape(-1)
            nbuf = torch.zeros(B * Hkv + B + 1, dtype=torch.int32)
            nbuf[1:1 + B * Hkv] = num_pages.reshape(-1)
            nbuf[1 + B * Hkv:] = last
            q = torch.randn(B, Hkv * G, D, generator=gen)
            out = paged_decode_attention(q, kc, vc, tbuf[3:].view(B, Hkv, W),
                                         nbuf[1:1 + B * Hkv].view(B, Hkv), nbuf[1 + B * Hkv:],
                                         D ** -0.5, num_splits=splits)
            torch.testing.assert_close(out.double(), _dense_attention(q, ks, vs, D ** -0.5),
                                       rtol=1e-4, atol=1e-4)
    split_modes = {dict((e[0], e[2]) for e in k if e[1] == "constexpr")["SPLIT"]
                   for k in log.keys["_paged_decode_kernel"]}
    assert split_modes == {"True", "False"}
    assert len(log.keys["_paged_decode_kernel"]) == 2, log.keys["_paged_decode_kernel"]
    assert len(log.keys["_merge_splits_kernel"]) == 1, log.keys["_merge_splits_kernel"]


def test_eager_select_compiles_one_kernel_per_phase_whatever_the_batch(monkeypatch):
    """The fused select at the full width of a 128k-token table (4,096 pages, as eager steps
    now run it) for every batch size an eager hybrid step can have (1 to 17 decode rows; the
    split heuristic at the H200's 132 SMs): one key for the score phase and one for the
    select phase — the split count, chunks per program, partial strides and the merge tile
    do not follow the batch. Recorded without running (the interpreter could not)."""
    from sparseserve.kernels import page_select

    monkeypatch.setattr(page_select, "CPU_SMS", 132)
    D, Hkv, G, W = 128, 8, 4, 4096
    kmin = torch.zeros(W + 1, D)
    with SpecialisationLog(execute=False) as log:
        for B in range(1, 18):
            q = torch.zeros(B, Hkv * G, D)
            table = torch.zeros(B, Hkv, W, dtype=torch.int32)
            num = torch.full((B, Hkv), W, dtype=torch.int32)
            page_select.select_pages(q, kmin, kmin, table, num, None, 64, 1, 2)
    keys = log.keys["_page_select_kernel"]
    phases = {dict((e[0], e[2]) for e in k if e[1] == "constexpr")["DO_SELECT"] for k in keys}
    assert phases == {"True", "False"} and len(keys) == 2, \
        [describe_difference(k, keys - {k}) for k in keys]


def test_every_unspecialised_name_is_a_parameter_of_its_kernel():
    """Triton 3.6 ignores a name in do_not_specialize / do_not_specialize_on_alignment that is
    not a parameter: a typo there would silently bring a mid-serving compile back. Every
    kernel of sparseserve.kernels and sparseserve.transfer names real parameters."""
    import importlib
    import inspect
    import pkgutil

    import sparseserve.kernels
    import sparseserve.transfer
    from triton.runtime.interpreter import InterpretedFunction

    checked = 0
    for pkg in (sparseserve.kernels, sparseserve.transfer):
        for info in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            for obj in vars(mod).values():
                if not isinstance(obj, InterpretedFunction) or obj.fn.__module__ != mod.__name__:
                    continue
                params = list(inspect.signature(obj.fn).parameters)
                for kind in ("do_not_specialize", "do_not_specialize_on_alignment"):
                    for name in obj.kwargs.get(kind) or []:
                        assert (params[name] if isinstance(name, int) else name) in params, \
                            f"{mod.__name__}.{obj.fn.__name__}: {kind} names {name!r}"
                        checked += 1
    assert checked >= 40  # this session's flags are all seen
