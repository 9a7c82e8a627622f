"""Key codes decoded on a few channels chosen per query, SparQ-style: ``keycode2-sparq``.

``keycode2`` (``sparse/keycodes.py``) scores pages by the approximate attention mass of their
tokens, from 2-bit codes of every channel of every token; its select reads all of them (9.4 %
of the KV bytes). ``keycode2-c4`` (``sparse/keycode_channels.py``) codes only the widest
channels of each page, a different set per page, so its select gathers the query per page.
Here every channel keeps keycode2's codes, and the select decodes R of them, the same R for
every page of a (request, layer, KV head) row: the channels with the largest
``sum_g |q_gc| * width_c``, ``width_c`` = the channel's ``kmax - kmin`` summed over the row's
full pages before its last. Token t's approximate logit for query head g is
``q_g . mean + q_g[R] . (k^_t[R] - mean[R])`` — the int8 page mean on every channel, keycode2's
decoded key ``kmin + (kmax - kmin) * (code + 0.5) / 4`` on the chosen ones — and pages are
scored as keycode2 scores them (``KeyCodes.from_token_logits``: per query head a softmax over
every token of the full pages, summed per page and over the GQA group). R = D is keycode2.
This is ``benchmarks/fidelity_keycode_channels.py``'s evaluation variant ``keycode2-sparq-w16``
(docs/results/fidelity.md: it met every issue-11 fidelity target), made an engine algorithm:
tests/sparse/test_keycode_sparq.py holds its scores equal to the variant's.

Summaries per page and KV head (layout: ``kernels/ref_sparq.py``):

* ``kmin``, ``kmax`` [D] (KV dtype): keycode2's box, the codes' range;
* ``codes`` [D * page_size / 16] int32: 2 bits per (channel, token), **channel-major** (channel
  c's page_size codes in page_size / 16 consecutive words), so a select reads the R chosen
  channels' words and no others (keycode2 packs token-major);
* ``kmean`` [D] int8 and ``kscale`` [1] fp32: the page mean, int8 times absmax / 127
  (``keycode2-c4``'s);
* ``wsum`` [D] fp32: the width sum of the row's pages 0..p, kept up to date by the Triton
  channel choice for the row's last full page before its last (-1 = not yet: ``index`` writes
  that; ``kernels/sparq_codes.py``): per-request state needs a per-page row here, since
  ``index`` does not know a page's row.

Bytes per page and KV head, page 32, bf16 KV: stored ``4D + 8D + D + 4 + 4D`` = 17 D + 4
(1092 B at D 64, 2180 B at D 128: 13.3 % of the page's K + V; keycode2 9.4 %, c4 3.3 %;
without ``wsum`` 10.2 %). Read by a select, by the bytes it uses: ``D + 4`` (mean, scale) +
``R * (2 + 2 + 8)`` (the chosen channels' box and codes) = ``68 + 12 R`` B at D 64 (260 B at
R 16: 3.2 % of K + V, c4's 3.3 %; 324 B = 2.0 % at D 128), plus per row and step one [D] fp32
``wsum`` row (and every page_size steps one more row and a box). The memory system moves
whole 32-byte sectors, though, and R channels chosen among D scatter over the page's rows:
the mean (one sector more for the scale), 2 D / 32 box sectors of which a channel set hits
``1 - C(D - 16, R) / C(D, R)``, D / 4 code sectors hit with ``1 - C(D - 4, R) / C(D, R)``:
about 706 B per page at D 64, R 16 (keycode2 reads 768 B) and 1048 B at D 128 (6.4 % of K + V;
keycode2 1536 B). A record layout per channel (box, codes, padding: 16 B, two channels per
sector) would cut that to ~550 / ~640 B; not done: the H200 timing decides first.

``select`` is two launches: ``kernels.sparq_channels`` (the channel choice; on CPU its torch
reference recomputes the width sums instead of caching them) and the fused
``kernels.select_pages(..., sparq_chan=)``, whose score phase is ``kernels/sparq_tiles.py``
(the page terms ``q . mean`` + ``q[R] . (lo + step / 2 - mean[R])`` as dots over 64 pages,
then per 16 pages one ``[256 tokens, 2 R] x [2 R, 2 GP]`` dot of the decoded codes laid out
so that each page's tokens stay in one warp; then the page mass, threshold and compaction
shared with the other algorithms). Its first version, ``sparq_codes.sparq_page_x``, measured
1.5 ms per layer at 128k x 16 on the H200 (0.8x dense), arithmetic-bound; ``score_kernel`` /
``decode_asm`` (class attributes, None: the ``SPARSESERVE_SPARQ_KERNEL`` / ``_ASM`` defaults)
pick the version and the bf16x2 decode for comparisons. ``score`` (the generic path,
``SPARSESERVE_FUSED_SELECT=0``) uses ``kernels.sparq_page_bounds``. Fixed shapes, no host
synchronisation. Needs page_size a multiple of 16; the Triton score kernels need R >= 16 (a
power of two) and run the reference otherwise.
"""
from __future__ import annotations

import math
import os

import torch

from sparseserve.kernels import select_pages, sparq_channels, sparq_page_bounds
from sparseserve.kernels.ref import mass_from_bounds
from sparseserve.kernels.ref_sparq import unpack_channel_codes
from sparseserve.sparse.base import Selection, SparseAlgorithm, register
from sparseserve.sparse.keycodes import KeyCodes, pack_codes

LEVELS = 4  # 2-bit codes


@register("keycode2-sparq")
class KeyCodeSparQ(SparseAlgorithm):
    """keycode2's codes (channel-major) + the int8 page mean; each row decodes the R channels
    of largest |q| x summed width (module docstring)."""

    summary_names = ("kmin", "kmax", "codes", "kmean", "kscale", "wsum")
    bits = 2
    channels = 16  # R (at most head_dim)
    fused_select = os.environ.get("SPARSESERVE_FUSED_SELECT", "1") not in ("0", "")
    score_kernel = None  # the fused select's score phase: 2 sparq_tiles, 1 sparq_codes (None: env)
    decode_asm = None    # sparq_tiles' bf16x2 decode on the GPU (None: env)
    select_splits = None  # score programs per row (None: select_pages' heuristic / env)
    from_token_logits = KeyCodes.from_token_logits

    def decoded_channels(self, head_dim: int) -> int:
        return min(self.channels, head_dim)

    def summary_shapes(self, head_dim):
        if self.page_size % 16:
            raise ValueError(f"{self.name}: page_size {self.page_size} must be a multiple of 16 "
                             "(a channel's 2-bit codes fill whole int32 words)")
        return {"kmin": (head_dim,), "kmax": (head_dim,),
                "codes": (head_dim * self.page_size // 16,), "kmean": (head_dim,),
                "kscale": (1,), "wsum": (head_dim,)}

    def summary_dtypes(self):
        return {"codes": torch.int32, "kmean": torch.int8, "kscale": torch.float32,
                "wsum": torch.float32}

    def index(self, k_cache, page_ids, num_tokens, summaries, queries):
        """keycode2's box and codes (the same numbers, channel-major), the int8 mean, and the
        page's width sum marked not yet known."""
        live = page_ids >= 0
        rows = torch.where(live, page_ids, summaries["kmin"].shape[0] - 1).long()  # -> scratch
        k = k_cache[torch.where(live, page_ids, 0).long()].float()   # [N, ps, D]
        n, ps, d = k.shape
        ok = torch.arange(ps, device=k.device).view(1, -1, 1) < num_tokens.view(-1, 1, 1)
        lo = torch.where(ok, k, float("inf")).amin(1)
        hi = torch.where(ok, k, float("-inf")).amax(1)
        width = (hi - lo).clamp(min=1e-30).unsqueeze(1)
        code = ((k - lo.unsqueeze(1)) / width * LEVELS).floor().clamp(0, LEVELS - 1)
        code = torch.where(ok, code, 0.0).to(torch.int64)            # [N, ps, D]
        mean = torch.where(ok, k, 0.0).sum(1) / num_tokens.clamp(min=1).view(-1, 1).float()
        amax = mean.abs().amax(1, keepdim=True).clamp(min=1e-30)     # [N, 1]
        summaries["kmin"][rows] = lo.to(summaries["kmin"].dtype)
        summaries["kmax"][rows] = hi.to(summaries["kmax"].dtype)
        summaries["codes"][rows] = pack_codes(code.transpose(1, 2).reshape(n, d * ps), 2)
        summaries["kscale"][rows] = amax / 127
        summaries["kmean"][rows] = (mean / amax * 127).round().to(summaries["kmean"].dtype)
        # not ``wsum[rows] = -1.0``: on a CUDA tensor, a Python scalar assigned through a tensor
        # index becomes a CPU tensor copied to the GPU (index_put_), which CUDA-graph capture
        # of the decode step (that indexes the pages it fills) refuses
        summaries["wsum"].index_fill_(0, rows, -1.0)

    # ---- decoding (tests, analysis) ------------------------------------------------------------
    def page_mean(self, summaries, rows: torch.Tensor) -> torch.Tensor:
        """[*rows.shape, D] float32 page means."""
        return summaries["kmean"][rows].float() * summaries["kscale"][rows].float()

    def approx_keys(self, summaries, rows: torch.Tensor) -> torch.Tensor:
        """[*rows.shape, page_size, D] float32: keycode2's decoded keys of the pages at
        ``rows`` (every channel)."""
        lo = summaries["kmin"][rows].float()                                   # [..., D]
        hi = summaries["kmax"][rows].float()
        d = lo.shape[-1]
        words = summaries["codes"][rows].view(*rows.shape, d, -1)
        lev = (unpack_channel_codes(words).float() + 0.5) / LEVELS            # [..., D, ps]
        return (lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * lev).transpose(-1, -2)

    # ---- select ------------------------------------------------------------------------------
    def chosen_channels(self, q, page_table, num_pages, summaries) -> torch.Tensor:
        """[B, Hkv, R] int32: each row's decoded channels (``kernels.sparq_channels``)."""
        return sparq_channels(q, summaries["kmin"], summaries["kmax"], summaries["wsum"],
                              page_table, num_pages, self.decoded_channels(q.shape[-1]))

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """[B, Hkv, W]: approximate token attention mass per page (``kernels.sparq_page_bounds``
        over the row's channels, then ``ref.mass_from_bounds``); +inf kept / last page, -inf
        past num_pages."""
        ch = self.chosen_channels(q, page_table, num_pages, summaries)
        u = sparq_page_bounds(q, summaries["kmean"], summaries["kscale"], summaries["kmin"],
                              summaries["kmax"], summaries["codes"], ch, page_table, num_pages)
        return mass_from_bounds(u, num_pages, self.sink_pages, self.local_pages,
                                q.shape[-1] ** -0.5)

    def select(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """The channel choice, then one fused select (kernels.select_pages with
        ``sparq_chan``): the same set of pages as the generic select over score()."""
        if not self.fused_select or type(self).score is not KeyCodeSparQ.score:
            return super().select(q, page_table, num_pages, last_page_len, summaries, k_cache)
        pages, num_sel, blocks = self.select_kernel(q, page_table, num_pages, last_page_len,
                                                    summaries)
        return Selection(pages, num_sel, last_page_len, blocks)

    def select_kernel(self, q, page_table, num_pages, last_page_len, summaries, backend=None):
        """The fused path's kernels on ``backend`` (benchmarks time it directly) -> pages,
        num_sel, blocks as ``kernels.select_pages`` returns them."""
        ch = sparq_channels(q, summaries["kmin"], summaries["kmax"], summaries["wsum"],
                            page_table, num_pages, self.decoded_channels(q.shape[-1]),
                            backend=backend)
        return select_pages(q, summaries["kmin"], summaries["kmax"], page_table, num_pages,
                            last_page_len, self.budget_pages, self.sink_pages, self.local_pages,
                            backend=backend, num_splits=self.select_splits,
                            codes=summaries["codes"], bits=2,
                            kmean=summaries["kmean"], kscale=summaries["kscale"], sparq_chan=ch,
                            sparq_kernel=self.score_kernel, sparq_asm=self.decode_asm)

    def select_bytes_per_page(self, head_dim: int, element_size: int,
                              sectors: bool = False) -> float:
        """Summary bytes a select reads per page of a row: the int8 mean and its scale, the
        chosen channels' box entries and codes (``68 + 12 R`` at D 64, bf16); ``sectors``: the
        expected bytes of the 32-byte sectors they lie in, for R channels drawn at random
        (module docstring)."""
        r, d = self.decoded_channels(head_dim), head_dim
        code_b = self.page_size // 4  # one channel's codes
        if not sectors:
            return d + 4 + r * (2 * element_size + code_b)

        def hit(per):  # the chance that a sector of `per` channels holds a chosen one
            return 1 - math.comb(d - per, r) / math.comb(d, r) if d > per else 1.0

        box_per = max(1, 32 // element_size)
        code_per = max(1, 32 // code_b)
        return (-(-d // 32) * 32 + 32 + 2 * 32 * -(-d // box_per) * hit(box_per)
                + 32 * -(-d // code_per) * hit(code_per) * max(1, code_b // 32))
