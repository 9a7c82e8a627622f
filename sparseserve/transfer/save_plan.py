"""Where one step's new K/V rows go in the host tier, worked out once per step.

Every layer of a step saves its new rows to the same host pages and offsets (a page id names
the same frame in every layer), so the savers' host-side work on those ids — validation, page
region counts, device copies of the ids, the copy engine's run list — belongs to the step,
not to each of its layers: ``make_save_plan`` does it once and ``save(layer, k, v, plan)``
reuses it (DESIGN §6; 32 layers used to redo it 32 times, ~1 ms of host time per layer in a
2048-token prefill step of an MHA model).

``dest_runs`` is the copy engine's view: the rows sorted by host address and cut where the
addresses stop being consecutive. Host pages are handed out in chunks of consecutive ids per
(request, KV head), and a request's heads take adjacent chunks from a fresh pool, so a
prefill chunk's rows of one layer usually form a few runs of megabytes each.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .common import as_index_array, count_page_runs, page_runs

__all__ = ["SavePlan", "make_save_plan", "dest_runs", "dest_blocks"]


@dataclass
class SavePlan:
    """Validated host destinations of a step's rows: pages [T, H] int64 (< 0: not saved),
    offsets [T, H] or [T, 1] int64. ``rows`` live rows, ``regions`` page regions (a run of
    consecutive offsets of one head in one page; TransferStats.pages). ``cache``: what a
    saver derived from it (device copies of the ids, the run list), kept for the step's other
    layers."""
    pages: np.ndarray
    offsets: np.ndarray
    rows: int
    regions: int
    cache: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return self.pages.shape

    def on_device(self, name, arrays, device: torch.device) -> tuple[torch.Tensor, ...]:
        """numpy `arrays` derived from this plan as tensors on `device`, copied once per plan
        and kept under `name` (pinned, non-blocking on CUDA): the step's other layers reuse
        them. `arrays` may be a callable returning them: derived only the first time."""
        key = (name, str(device))
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = tuple(_to_device(a, device) for a in
                                          (arrays() if callable(arrays) else arrays))
        return hit

    def device_ids(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages [T, H], offsets [T, H] broadcast view) on `device`."""
        pages, offs = self.on_device("ids", (self.pages, self.offsets), device)
        return pages, offs.expand(self.pages.shape)


def make_save_plan(host_pages, offsets, num_pages: int, page_size: int,
                   validate: bool = True, shape: tuple[int, int] | None = None) -> SavePlan:
    """host_pages [T, H] (numpy, list or tensor; a CUDA tensor syncs; broadcast to `shape`
    when given), offsets [T], [T, 1] or [T, H]; ids must be < num_pages and offsets in
    [0, page_size) on live rows."""
    if shape is None:
        shape = np.shape(host_pages.detach().cpu() if torch.is_tensor(host_pages)
                         else host_pages)
        if len(shape) != 2:
            raise ValueError(f"host_pages must be [T, Hkv], got shape {shape}")
    pages = as_index_array(host_pages, "host_pages", tuple(shape))
    offs = as_index_array(offsets, "offsets", tuple(shape), allow_column=True)
    if validate and pages.size:
        live = pages >= 0
        if pages.max() >= num_pages:
            raise IndexError(f"host page id {int(pages.max())} out of range (< {num_pages})")
        o = offs[live.any(axis=1), 0] if offs.shape[1] == 1 else offs[live]
        if o.size and (o.min() < 0 or o.max() >= page_size):
            raise IndexError(f"token offset out of range [0, {page_size})")
    return SavePlan(pages, offs, int((pages >= 0).sum()), count_page_runs(pages, offs))


def dest_runs(plan: SavePlan, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The live rows in host-address order, cut into runs of consecutive addresses.

    -> (t [R], h [R]: the rows in that order, i.e. staging row i is new[t[i], h[i]];
    runs [n, 3] int64: (first host row = page * page_size + offset, first staging row,
    length)). Works on page regions (one per page and head), not on rows: ~T / page_size * H
    entries to sort."""
    hit = plan.cache.get(("runs", page_size))
    if hit is not None:
        return hit
    head, t0, length, page, off0 = page_runs(plan.pages, plan.offsets)
    addr = page * page_size + off0
    order = np.argsort(addr, kind="stable")
    addr, length, head, t0 = addr[order], length[order], head[order], t0[order]
    src = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    total = int(length.sum())
    t = np.repeat(t0 - src, length) + np.arange(total, dtype=np.int64)
    h = np.repeat(head, length)
    if addr.size:
        first = np.concatenate([[0], np.flatnonzero(addr[1:] != addr[:-1] + length[:-1]) + 1])
        ends = np.concatenate([src[first[1:]], [total]])
        runs = np.stack([addr[first], src[first], ends - src[first]], axis=1)
    else:
        runs = np.zeros((0, 3), np.int64)
    hit = plan.cache[("runs", page_size)] = (t, h, runs)
    return hit


def dest_blocks(plan: SavePlan, page_size: int,
                strided: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dest_runs with equally long, equally spaced neighbouring runs grouped into blocks, each
    one strided copy (memcpy2d.copy_rows_2d): where a step starts or ends inside a page or a
    chunk, every KV head has a partial run of the same length, one head's chunk apart.
    strided=False: one block per run (for a copier without strided copies).

    -> (t [R], h [R] as dest_runs; blocks [m, 5] int64: (first host row, host rows between
    the block's runs, first staging row, run length, runs)). Staging rows stay in address
    order, so a block's runs are consecutive there."""
    key = ("blocks", page_size, strided)
    hit = plan.cache.get(key)
    if hit is not None:
        return hit
    t, h, runs = dest_runs(plan, page_size)
    if not strided:
        ones = np.ones_like(runs[:, 0])
        hit = plan.cache[key] = (t, h, np.stack([runs[:, 0], runs[:, 2], runs[:, 1],
                                                 runs[:, 2], ones], 1))
        return hit
    blocks = []
    i, n = 0, len(runs)
    while i < n:
        dst, src, length = (int(x) for x in runs[i])
        j, pitch = i + 1, 0
        while j < n and int(runs[j, 2]) == length:
            step = int(runs[j, 0] - runs[j - 1, 0])
            if pitch and step != pitch:
                break
            pitch = step
            j += 1
        blocks.append((dst, pitch or length, src, length, j - i))
        i = j
    arr = np.asarray(blocks, np.int64).reshape(-1, 5)
    hit = plan.cache[key] = (t, h, arr)
    return hit


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
