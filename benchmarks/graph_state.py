"""The device state a decode step changes, and how two runs of one step differ (graph_check.py).

`tracked_state(runner)` names every device tensor the decode step may write: the two-tier
cache's bookkeeping (page_of, last_access, owner, residency index and its fill count, quotas,
counters), its device KV slots (dev_k/dev_v per layer), the page loader's counters and the
sparse summaries of every layer. Host tensors (the DRAM tier, pinned staging) are left out:
the step writes the decode tokens there by value, so a rerun writes the same bytes.

`diff_states(a, b, ...)` compares two snapshots: integer tensors exactly (the residency index
by what it answers, since parallel inserts may lay the same entries out differently), float
tensors bitwise (same kernels, same shapes: no tolerance is due), and reports the first
differing positions of each tensor so a failing step says where it went wrong.
"""
from __future__ import annotations

import torch

from sparseserve.transfer.common import bits_view


def tracked_state(runner) -> dict[str, torch.Tensor]:
    """name -> device tensor (views of the live state, not copies)."""
    off = runner.offload
    state: dict[str, torch.Tensor] = {}
    if off is not None:
        for name, value in vars(off).items():
            # private tensors are the host tier and pinned staging (see the module doc)
            if isinstance(value, torch.Tensor) and not name.startswith("_"):
                state[name] = value
        for i, (k, v) in enumerate(zip(off.dev_k, off.dev_v)):
            state[f"dev_k.{i}"], state[f"dev_v.{i}"] = k, v
        state["loader_counter"] = off.loader.counter(off.page_of.device)
    else:
        for i, (k, v) in enumerate(zip(runner.kv.k, runner.kv.v)):
            state[f"kv_k.{i}"], state[f"kv_v.{i}"] = k, v
    if runner.sparse is not None:
        for layer, s in enumerate(runner.sparse.summaries):
            if s is not None:
                for name, t in s.tensors.items():
                    state[f"summary.{layer}.{name}"] = t
    return state


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in state.items()}


def restore(state: dict[str, torch.Tensor], snap: dict[str, torch.Tensor]) -> None:
    for name, t in state.items():
        t.copy_(snap[name])


def _first_diffs(a: torch.Tensor, b: torch.Tensor, limit: int) -> list[dict]:
    idx = torch.nonzero(a != b)[:limit]
    return [{"index": i.tolist(), "a": a[tuple(i)].item(), "b": b[tuple(i)].item()}
            for i in idx]


def _index_answers(table, page_of) -> torch.Tensor:
    """Per layer: the slot the residency index returns for every page page_of maps."""
    from sparseserve.kernels import residency_hash
    out = []
    for layer in range(page_of.shape[0]):
        pages = page_of[layer][page_of[layer] >= 0]
        out.append(residency_hash.lookup(table[layer], page_of[layer], pages))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def diff_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                limit: int = 8) -> dict[str, dict]:
    """Tensors of snapshot a and b that differ -> {name: {count, first: [...]}} (empty when
    the two runs left the same state). res_table is compared by its answers for the pages
    page_of maps in each run (layouts may differ), both against page_of's own slots."""
    out: dict[str, dict] = {}
    for name in a:
        x, y = a[name], b[name]
        if name == "res_table":
            continue
        if x.shape != y.shape:
            out[name] = {"count": -1, "shapes": [list(x.shape), list(y.shape)]}
            continue
        if x.is_floating_point():
            if not torch.equal(bits_view(x), bits_view(y)):
                d = (x.float() - y.float()).abs()
                out[name] = {"count": int((d != 0).sum()), "max_abs": float(d.max()),
                             "first": _first_diffs(x.float(), y.float(), limit)}
            continue
        if not torch.equal(x, y):
            out[name] = {"count": int((x != y).sum()), "first": _first_diffs(x, y, limit)}
    if "res_table" in a and "page_of" in a:
        for tag, snap in (("a", a), ("b", b)):
            got = _index_answers(snap["res_table"], snap["page_of"])
            want = torch.cat([torch.nonzero(snap["page_of"][layer] >= 0).flatten()
                              for layer in range(snap["page_of"].shape[0])])
            if not torch.equal(got, want):
                out[f"res_table.{tag}"] = {"count": int((got != want).sum()),
                                           "first": _first_diffs(got, want, limit)}
    return out


def range_errors(state: dict[str, torch.Tensor], num_slots: int, num_host_pages: int,
                 num_rows: int) -> list[str]:
    """Ids in the cache's bookkeeping that no kernel may follow (an out-of-range write that
    landed in them would show here before a later step faults on it)."""
    errs = []
    po = state.get("page_of")
    if po is not None and ((po < -1) | (po > num_host_pages)).any():
        errs.append(f"page_of outside [-1, {num_host_pages}]")
    own = state.get("owner")
    if own is not None and ((own < 0) | (own > num_rows)).any():
        errs.append(f"owner outside [0, {num_rows}]")
    tab = state.get("res_table")
    if tab is not None and ((tab < -1) | (tab >= num_slots)).any():
        errs.append(f"res_table entries outside [-1, {num_slots})")
    return errs
