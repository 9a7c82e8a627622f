"""Key codes on a few channels per page: ``keycode2``'s token-level scoring at ArkVale's bytes.

Why: ``keycode2`` (``sparse/keycodes.py``) reaches the exact top-k oracle's fidelity, but its
select reads 2 bits of every channel of every token plus a min/max box (9.4 % of the KV bytes),
so select + attend cannot fall under 1/10 of dense decode at 128k (docs/results/sparse.md:
>= 12 % by bytes alone). Most of a key's logit error under a page-level summary comes from
the few channels whose values spread widely inside the page; the others are close to their
page mean whatever the token. So each page keeps

* ``kmean`` [D] int8 and ``kscale`` [1] float32: the mean of its keys per channel, as int8 times
  the page's absmax / 127;
* ``chan``: the ``r`` channels with the widest min/max range in this page (8-bit indices,
  four per int32 word), chosen at index time per page (no per-request state);
* ``klo`` / ``khi`` [r]: those channels' min and max (KV dtype);
* ``codes``: 2 bits per token per chosen channel, levels ``(i + 0.5) / 4`` of the range
  (``page_size * r * 2 / 32`` int32 words).

Token t's approximate key is the page mean on every channel except the chosen ones, where it
is ``klo + (khi - klo) * level(code)``; pages are scored exactly as ``keycode2`` scores them
(approximate token attention mass: per query head a softmax over every token of the full
pages, summed per page and over the GQA group; ``KeyCodes.from_token_logits``).

Bytes per page and KV head at page 32, bf16 (any head_dim, r = D / 8 | D / 4 | D / 2):
``D + 4 + 4r + r + 8r`` B = 2.0 % (``keycode2-c8``) / 3.3 % (``keycode2-c4``) / 5.9 %
(``keycode2-c2``) of the page's K+V
bytes, against ArkVale's 3.1 % and keycode2's 9.4 % (a bf16 mean: 2.8 % / 4.1 %).

``score`` computes the logits without decoding whole keys: ``q . kmean`` per page plus
``q[chan] . (k^[chan] - kmean[chan])`` per token (``kernels.channel_code_page_bounds``: Triton
on CUDA, ``kernels/channel_codes.py``; the torch spec ``ref.channel_code_page_bounds`` on
CPU, whose scratch is ``[B, Hkv, G, W, page_size, r]``, r / D of a decoded key tensor). ``select`` is
the fused ``kernels.select_pages`` with the channel codes (score phase
``channel_codes.chan_code_page_x``; the generic select over ``score`` with
``SPARSESERVE_FUSED_SELECT=0``). Fixed shapes, no host synchronisation.
"""
from __future__ import annotations

import torch

from sparseserve.kernels import channel_code_page_bounds, select_pages
from sparseserve.kernels.ref import mass_from_bounds
from sparseserve.sparse.base import Selection, register
from sparseserve.sparse.keycodes import KeyCodes, pack_codes, unpack_codes

BITS = 2
LEVELS = 1 << BITS


class KeyCodeChannels(KeyCodes):
    """2-bit token codes on the ``head_dim // channel_divisor`` widest channels of each page,
    the page mean elsewhere; see the module docstring."""

    summary_names = ("kmean", "klo", "khi", "chan", "codes")
    bits = BITS
    channel_divisor = 8
    # the page mean as int8 times a per-page absmax scale (``kscale``) instead of the KV dtype:
    # D + 4 bytes instead of 2 D at bf16; measured to cost nothing at 2048 and 0.3 point of
    # top-1 at 512 (docs/results/fidelity.md). False is kept for the kernels' tests.
    int8_mean = True

    def coded_channels(self, head_dim: int) -> int:
        """head_dim / channel_divisor, rounded up to a multiple of 4 (channel indices are packed
        four to a word), at least 4."""
        if head_dim % 4 or head_dim > 256:
            raise ValueError(f"{self.name}: head_dim {head_dim} must be a multiple of 4 and at "
                             "most 256 (8-bit channel indices, four per word)")
        return max(4, -(-(head_dim // self.channel_divisor) // 4) * 4)

    def summary_shapes(self, head_dim):
        r = self.coded_channels(head_dim)
        nw = self.page_size * r * BITS // 32
        assert nw * 32 == self.page_size * r * BITS, "page codes must fill words"
        shapes = {"kmean": (head_dim,), "klo": (r,), "khi": (r,), "chan": (r // 4,),
                  "codes": (nw,)}
        if self.int8_mean:
            shapes["kscale"] = (1,)
        return shapes

    def summary_dtypes(self):
        dts = {"chan": torch.int32, "codes": torch.int32}
        if self.int8_mean:
            dts.update(kmean=torch.int8, kscale=torch.float32)
        return dts

    def index(self, k_cache, page_ids, num_tokens, summaries, queries):
        live = page_ids >= 0
        rows = torch.where(live, page_ids, summaries["kmean"].shape[0] - 1).long()  # -> scratch
        k = k_cache[torch.where(live, page_ids, 0).long()].float()   # [N, ps, D]
        n, ps, d = k.shape
        r = self.coded_channels(d)
        ok = torch.arange(ps, device=k.device).view(1, -1, 1) < num_tokens.view(-1, 1, 1)
        cnt = num_tokens.clamp(min=1).view(-1, 1).float()
        mean = torch.where(ok, k, 0.0).sum(1) / cnt                   # [N, D]
        lo = torch.where(ok, k, float("inf")).amin(1)
        hi = torch.where(ok, k, float("-inf")).amax(1)
        width = torch.where(num_tokens.view(-1, 1) > 0, hi - lo, 0.0)
        worth = self.channel_worth(k, ok, mean, width, queries)
        # the r channels most worth coding, in channel order (ties: the lower channel)
        chan = worth.topk(r, dim=1).indices.sort(dim=1).values        # [N, r]
        kc = k.gather(2, chan.unsqueeze(1).expand(n, ps, r))          # [N, ps, r]
        clo, chi = lo.gather(1, chan), hi.gather(1, chan)
        w = (chi - clo).clamp(min=1e-30).unsqueeze(1)
        code = ((kc - clo.unsqueeze(1)) / w * LEVELS).floor().clamp(0, LEVELS - 1)
        code = torch.where(ok, code, 0.0).to(torch.int64)
        if self.int8_mean:
            amax = mean.abs().amax(1, keepdim=True).clamp(min=1e-30)   # [N, 1]
            summaries["kscale"][rows] = amax / 127
            mean = (mean / amax * 127).round()
        summaries["kmean"][rows] = mean.to(summaries["kmean"].dtype)
        summaries["klo"][rows] = clo.to(summaries["klo"].dtype)
        summaries["khi"][rows] = chi.to(summaries["khi"].dtype)
        summaries["chan"][rows] = pack_codes(chan, 8)
        summaries["codes"][rows] = pack_codes(code.reshape(n, ps * r), BITS)

    def channel_worth(self, k, ok, mean, width, queries):
        """[N, D]: how much coding each channel of each page is worth; the top r get codes.
        The range (max - min) in the page: the worst case of the page mean's error there.
        (Measured against the within-page variance and against variance x the filling
        queries' energy: neither chose better; docs/results/fidelity.md.)"""
        return width

    def _decoded(self, summaries, rows: torch.Tensor):
        """(kmean [*rows, D], chan [*rows, r] int64, deviation of the coded channels from the
        mean [*rows, page_size, r]) float32, for the pages at ``rows``."""
        mean = summaries["kmean"][rows].float()
        if self.int8_mean:
            mean = mean * summaries["kscale"][rows].float()
        chan = unpack_codes(summaries["chan"][rows], 8)               # [..., r]
        lo = summaries["klo"][rows].float()
        hi = summaries["khi"][rows].float()
        r = lo.shape[-1]
        lev = self.levels(unpack_codes(summaries["codes"][rows], BITS))
        lev = lev.view(*rows.shape, self.page_size, r)
        val = lo.unsqueeze(-2) + (hi - lo).unsqueeze(-2) * lev
        return mean, chan, val - mean.gather(-1, chan).unsqueeze(-2)

    def approx_keys(self, summaries, rows: torch.Tensor) -> torch.Tensor:
        """[*rows.shape, page_size, D] float32 approximate keys of the pages at ``rows``."""
        mean, chan, dev = self._decoded(summaries, rows)
        keys = mean.unsqueeze(-2).expand(*rows.shape, self.page_size, mean.shape[-1]).clone()
        idx = chan.unsqueeze(-2).expand(*rows.shape, self.page_size, chan.shape[-1])
        return keys.scatter_add_(-1, idx, dev)

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """[B, Hkv, W]: approximate token attention mass per page (keycode2's, from these
        summaries: ``kernels.channel_code_page_bounds``, then ``ref.mass_from_bounds``);
        +inf kept / last page, -inf past num_pages."""
        u = channel_code_page_bounds(q, summaries["kmean"], summaries["klo"], summaries["khi"],
                                     summaries["chan"], summaries["codes"], page_table,
                                     num_pages, summaries["kscale"] if self.int8_mean else None)
        return mass_from_bounds(u, num_pages, self.sink_pages, self.local_pages,
                                q.shape[-1] ** -0.5)


    def select(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """One fused kernel (kernels.select_pages with the channel codes): the same set of
        pages as the generic select over score()."""
        if not self.fused_select or type(self).score is not KeyCodeChannels.score:
            return super(KeyCodes, self).select(q, page_table, num_pages, last_page_len,
                                                summaries, k_cache)
        pages, num_sel, blocks = select_pages(
            q, summaries["klo"], summaries["khi"], page_table, num_pages, last_page_len,
            self.budget_pages, self.sink_pages, self.local_pages, codes=summaries["codes"],
            bits=BITS, kmean=summaries["kmean"], chan=summaries["chan"],
            kscale=summaries["kscale"] if self.int8_mean else None)
        return Selection(pages, num_sel, last_page_len, blocks)


@register("keycode2-c2")
class KeyCode2Half(KeyCodeChannels):
    """2-bit codes on head_dim / 2 channels per page (5.9 % of the KV bytes)."""

    channel_divisor = 2


@register("keycode2-c8")
class KeyCode2Eighth(KeyCodeChannels):
    """2-bit codes on head_dim / 8 channels per page (2.0 % of the KV bytes)."""

    channel_divisor = 8


@register("keycode2-c4")
class KeyCode2Quarter(KeyCodeChannels):
    """2-bit codes on head_dim / 4 channels per page (3.3 % of the KV bytes)."""

    channel_divisor = 4


