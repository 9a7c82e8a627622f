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

Summaries per page and KV head. **Records** (the default; ``kernels/sparq_records.py``): ``rec``
[D records of NR int32 words, allocated in the KV dtype] -- per channel its ``kmin``, ``kmax``,
code words and width sum in 16 bytes (bf16, page 32), so a select's R chosen channels cost one
record each -- plus ``kmean`` and ``kscale``. On CUDA with the two-tier cache (host pages in
aligned chunks of 16 per request and KV head) the records are **interleaved** per chunk,
channel-major (``sparq_records.interleave``, ``LayerSummaries.interleave``): a chosen channel
of a 16-page sub-tile is one contiguous 256-byte run instead of 16 pieces of 16 bytes, each a
64-byte DRAM burst (docs/results/sparse.md, twenty-sixth session: 0.128x -> 0.115x dense). ``records = False`` (``keycode2-sparq@records=0``)
keeps the first layout, the same numbers in separate rows (``kernels/ref_sparq.py``); ``views``
gives either as the first layout's tensors (the records' as strided views), and every kernel
and reference reads them through channel strides, so both layouts select the same pages:

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
without ``wsum`` 10.2 %); the records store exactly as much (the width sum fills the record's
fourth word). Read by a select, by the bytes it uses: ``D + 4`` (mean, scale) +
``R * (2 + 2 + 8)`` (the chosen channels' box and codes) = ``68 + 12 R`` B at D 64 (260 B at
R 16: 3.2 % of K + V, c4's 3.3 %; 324 B = 2.0 % at D 128), plus per row and step one [D] fp32
``wsum`` row (and every page_size steps one more row and a box). The memory system moves
whole 32-byte sectors, though, and R channels chosen among D scatter over the page's rows:
first layout, the mean (one sector more for the scale), 2 D / 32 box sectors of which a
channel set hits ``1 - C(D - 16, R) / C(D, R)``, D / 4 code sectors hit with
``1 - C(D - 4, R) / C(D, R)``: about 706 B per page at D 64, R 16 (keycode2 reads 768 B) and
1048 B at D 128 (6.4 % of K + V; keycode2 1536 B). Records: the mean and scale, then D / 2
sectors of two records each, hit with ``1 - C(D - 2, R) / C(D, R)``: ~547 B at D 64 and
~642 B at D 128 (3.9 %; ``select_bytes_per_page``). (fp32 KV pads its records to 8 words.)

``select`` is two launches: ``kernels.sparq_channels`` (the channel choice; on CPU its torch
reference recomputes the width sums instead of caching them) and the fused
``kernels.select_pages(..., sparq_chan=)``, whose score phase is ``kernels/sparq_stream.py``
(per 16 pages: the page terms ``q . mean`` + ``q[R] . (lo + step / 2 - mean[R])`` as two
16-row dots, then one ``[256 tokens, 2 R] x [2 R, 2 GP]`` dot of the decoded codes laid out
so that each page's tokens stay in one warp, all in registers; ``sparq_tiles`` does the page
terms over 64 pages through the score row, 1.37x slower on the H100; then the page mass,
threshold and compaction shared with the other algorithms). Its first version,
``sparq_codes.sparq_page_x``, measured
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

from sparseserve.kernels import (resolve_backend, select_pages, sparq_channels,
                                 sparq_page_bounds, sparq_supported)
from sparseserve.kernels.ref import mass_from_bounds
from sparseserve.kernels.ref_sparq import unpack_channel_codes
from sparseserve.kernels.sparq_records import (deinterleave, pack_records, record_views,
                                               record_word_offsets, record_words)
from sparseserve.kernels.sparq_tiles import SPARQ_KERNEL
from sparseserve.sparse.base import LayerSummaries, Selection, SparseAlgorithm, register
from sparseserve.sparse.keycodes import KeyCodes, pack_codes

LEVELS = 4  # 2-bit codes


@register("keycode2-sparq")
class KeyCodeSparQ(SparseAlgorithm):
    """keycode2's codes (channel-major) + the int8 page mean; each row decodes the R channels
    of largest |q| x summed width (module docstring)."""

    # the record layout's (``records = False``: kmin, kmax, codes, kmean, kscale, wsum)
    summary_names = ("rec", "kmean", "kscale")
    records = True  # the record layout (False: the first one, for comparisons)
    bits = 2
    channels = 16  # R (at most head_dim)
    fused_select = os.environ.get("SPARSESERVE_FUSED_SELECT", "1") not in ("0", "")
    score_kernel = None  # score phase: 5 sparq_lanes (the default on CUDA), 3 sparq_stream (the
    # default interpreted; 4: 2-warp split programs), 2 sparq_tiles, 1 sparq_codes (None: env)
    decode_asm = None    # sparq_tiles' bf16x2 decode on the GPU (None: env)
    select_splits = None  # score programs per row (None: select_pages' heuristic / env)
    select_warps = None  # warps per select program (None: select_pages' choice / env)
    # records interleaved in chunks of this many pages (``sparq_records.interleave``): None,
    # the page ids' allocation chunk (make_summaries' ``page_chunk``: 16 host pages with the
    # two-tier cache) for summaries on CUDA, else 1; an int forces it (tests, benchmarks)
    interleave = None
    indexes_apart = True  # index() takes write_ids: no scratch table (its rows would be pages)
    from_token_logits = KeyCodes.from_token_logits

    def decoded_channels(self, head_dim: int) -> int:
        return min(self.channels, head_dim)

    def summary_shapes(self, head_dim, element_size=2):
        """Row shapes; the records' row is in KV-dtype elements, so it depends on
        ``element_size`` (``make_summaries`` and ``summary_bytes_per_page`` pass it)."""
        if self.page_size % 16:
            raise ValueError(f"{self.name}: page_size {self.page_size} must be a multiple of 16 "
                             "(a channel's 2-bit codes fill whole int32 words)")
        if self.records:
            nr = record_words(element_size, self.page_size)
            return {"rec": (head_dim * nr * 4 // element_size,), "kmean": (head_dim,),
                    "kscale": (1,)}
        return {"kmin": (head_dim,), "kmax": (head_dim,),
                "codes": (head_dim * self.page_size // 16,), "kmean": (head_dim,),
                "kscale": (1,), "wsum": (head_dim,)}

    def summary_dtypes(self):
        return {"codes": torch.int32, "kmean": torch.int8, "kscale": torch.float32,
                "wsum": torch.float32}  # rec: the KV dtype (its box's), read as int32 words

    def make_summaries(self, rows, head_dim, dtype=torch.float32, device=None, page_chunk=1):
        """The records' rows are rounded up to a multiple of the interleave (``interleave``):
        the scratch row stays row ``rows - 1`` of every summary."""
        shapes, dts = self.summary_shapes(head_dim, dtype.itemsize), self.summary_dtypes()
        ri = self.record_interleave(torch.device(device or "cpu"), page_chunk, dtype.itemsize)
        return LayerSummaries({n: torch.zeros((-(-rows // ri) * ri if n == "rec" else rows,
                                               math.prod(s)), dtype=dts.get(n, dtype),
                                              device=device)
                               for n, s in shapes.items()}, shapes, interleave=ri)

    def record_interleave(self, device: torch.device, page_chunk: int,
                          element_size: int) -> int:
        """Pages per interleaved chunk of the records (``interleave``); 1 without records or
        with records the score phases do not load whole (other than 4 words: fp32 KV at page
        32, page 64), whose kernels read them through strided views. By default only where
        the select is the fused one with a score phase that loads records whole (2-4): the
        generic path and ``sparq_codes`` read rows, and would de-interleave a copy per call."""
        if not self.records or record_words(element_size, self.page_size) != 4:
            return 1
        if self.interleave is not None:
            return max(1, int(self.interleave))
        fused = self.fused_select and type(self).score is KeyCodeSparQ.score
        whole = fused and self._score_phase_reads_records_whole()
        return page_chunk if device.type == "cuda" and whole else 1

    def _score_phase_reads_records_whole(self) -> bool:
        """The fused select's score phase loads whole records (``sparq_tiles`` /
        ``sparq_stream``: 2-4, ``sparq_lanes``: 5), where the interleave's addressing applies;
        ``sparq_codes`` (1) reads them through their row views."""
        # 0: the default, 5 on CUDA (3 interpreted): both read whole records
        return (self.score_kernel or SPARQ_KERNEL) in (0, 2, 3, 4, 5)

    def summary_bytes(self, rows, head_dim, element_size, device_type="cpu", page_chunk=1):
        """``make_summaries``' bytes: the records' rows rounded up to whole chunks."""
        ri = self.record_interleave(torch.device(device_type), page_chunk, element_size)
        pad = -(-rows // ri) * ri - rows
        rec = math.prod(self.summary_shapes(head_dim, element_size)["rec"]) * element_size \
            if self.records else 0
        return rows * self.summary_bytes_per_page(head_dim, element_size) + pad * rec

    def summary_bytes_per_page(self, head_dim, element_size):
        dts = self.summary_dtypes()
        return sum(math.prod(s) * (dts[n].itemsize if n in dts else element_size)
                   for n, s in self.summary_shapes(head_dim, element_size).items())

    def views(self, summaries) -> dict[str, torch.Tensor | None]:
        """Either layout as the first layout's tensors: ``kmin``, ``kmax`` [S, D], ``codes``
        [S, D, page_size / 16] int32, ``wsum`` [S, D] fp32 (strided views of the records in
        the record layout), ``kmean``, ``kscale``, and ``rec`` [S, D * NR] int32 (the records
        as words; None in the first layout). Interleaved records (``summaries.interleave`` >
        1) are de-interleaved into a copy first: right for reading (the references, the
        generic path), not for writing — the kernels read them in place (``_kernel_views``)."""
        return self._kernel_views(summaries, plain=True)

    def _kernel_views(self, summaries, plain: bool = False) -> dict[str, torch.Tensor | None]:
        """``views`` without the de-interleaving copy: with interleaved records, the record
        views address a page's records as if in its row — only for kernels given
        ``rec_interleave`` = ``summaries.interleave``, which address them by it."""
        kmean, kscale = summaries["kmean"], summaries["kscale"]
        d = kmean.shape[1]
        if not self.records:
            codes = summaries["codes"]
            return {"kmin": summaries["kmin"], "kmax": summaries["kmax"],
                    "codes": codes.view(codes.shape[0], d, -1), "wsum": summaries["wsum"],
                    "kmean": kmean, "kscale": kscale, "rec": None}
        rec = summaries["rec"]
        words = rec.view(torch.int32)
        if plain and summaries.interleave > 1:
            words = deinterleave(words, words.shape[1] // d, summaries.interleave)
        return dict(record_views(words, rec.dtype, d, self.page_size), kmean=kmean,
                    kscale=kscale, rec=words)

    def index(self, k_cache, page_ids, num_tokens, summaries, queries, write_ids=None):
        """keycode2's box and codes (the same numbers, channel-major), the int8 mean, and the
        page's width sum marked not yet known; the box, codes and width as whole records in
        the record layout (where ``summaries.interleave`` puts them). Page ``page_ids[i]``'s
        summary goes to row ``write_ids[i]`` when given (``indexes_apart``)."""
        live = page_ids >= 0
        dest = page_ids if write_ids is None else write_ids
        rows = torch.where(live, dest, summaries["kmean"].shape[0] - 1).long()  # -> scratch
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
        words = pack_codes(code.transpose(1, 2).reshape(n, d * ps), 2)  # [N, D * ps / 16]
        summaries["kscale"][rows] = amax / 127
        summaries["kmean"][rows] = (mean / amax * 127).round().to(summaries["kmean"].dtype)
        if self.records:
            rec = summaries["rec"]
            nr = rec.view(torch.int32).shape[1] // d
            packed = pack_records(lo.to(rec.dtype), hi.to(rec.dtype), words.view(n, d, -1), nr)
            if summaries.interleave == 1:
                rec[rows] = packed.view(rec.dtype)
            else:  # index_copy_: no CPU scalar or host sync (capturable)
                offs = record_word_offsets(rows, d, nr, summaries.interleave)
                rec.view(torch.int32).view(-1).index_copy_(0, offs.view(-1), packed.view(-1))
            return
        summaries["kmin"][rows] = lo.to(summaries["kmin"].dtype)
        summaries["kmax"][rows] = hi.to(summaries["kmax"].dtype)
        summaries["codes"][rows] = words
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
        v = self.views(summaries)
        lo = v["kmin"][rows].float()                                           # [..., D]
        hi = v["kmax"][rows].float()
        words = v["codes"][rows]                                               # [..., D, nw]
        lev = (unpack_channel_codes(words).float() + 0.5) / LEVELS            # [..., D, ps]
        return (lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * lev).transpose(-1, -2)

    # ---- select ------------------------------------------------------------------------------
    def chosen_channels(self, q, page_table, num_pages, summaries) -> torch.Tensor:
        """[B, Hkv, R] int32: each row's decoded channels (``kernels.sparq_channels``)."""
        v = self.views(summaries)
        return sparq_channels(q, v["kmin"], v["kmax"], v["wsum"], page_table, num_pages,
                              self.decoded_channels(q.shape[-1]))

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """[B, Hkv, W]: approximate token attention mass per page (``kernels.sparq_page_bounds``
        over the row's channels, then ``ref.mass_from_bounds``); +inf kept / last page, -inf
        past num_pages."""
        ch = self.chosen_channels(q, page_table, num_pages, summaries)
        v = self.views(summaries)
        u = sparq_page_bounds(q, v["kmean"], v["kscale"], v["kmin"], v["kmax"], v["codes"], ch,
                              page_table, num_pages)
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
        num_sel, blocks as ``kernels.select_pages`` returns them. Interleaved records are read
        in place by the Triton kernels; the torch references get them de-interleaved."""
        r = self.decoded_channels(q.shape[-1])
        ri = summaries.interleave
        if ri > 1 and (resolve_backend(backend, q) == "torch"
                       or not self._score_phase_reads_records_whole()
                       or not sparq_supported(r, q.shape[-1], self.page_size * q.shape[-1] // 16)):
            ri = 1  # paths that read the records through their row views (or not whole)
        v = self._kernel_views(summaries, plain=ri == 1)
        ch = sparq_channels(q, v["kmin"], v["kmax"], v["wsum"], page_table, num_pages, r,
                            backend=backend, rec_interleave=ri)
        return select_pages(q, v["kmin"], v["kmax"], page_table, num_pages, last_page_len,
                            self.budget_pages, self.sink_pages, self.local_pages,
                            backend=backend, num_splits=self.select_splits,
                            num_warps=self.select_warps, codes=v["codes"],
                            bits=2, kmean=v["kmean"], kscale=v["kscale"], sparq_chan=ch,
                            sparq_kernel=self.score_kernel, sparq_asm=self.decode_asm,
                            sparq_rec=v["rec"], rec_interleave=ri)

    def select_bytes_per_page(self, head_dim: int, element_size: int,
                              sectors: bool = False) -> float:
        """Summary bytes a select reads per page of a row: the int8 mean and its scale, the
        chosen channels' box entries and codes (``68 + 12 R`` at D 64, bf16; records: the R
        whole records, ``68 + 16 R``); ``sectors``: the expected bytes of the 32-byte sectors
        they lie in, for R channels drawn at random (module docstring)."""
        r, d = self.decoded_channels(head_dim), head_dim
        code_b = self.page_size // 4  # one channel's codes
        rec_b = 4 * record_words(element_size, self.page_size)  # one record
        if not sectors:
            return d + 4 + r * (rec_b if self.records else 2 * element_size + code_b)

        def hit(per):  # the chance that a sector of `per` channels holds a chosen one
            return 1 - math.comb(d - per, r) / math.comb(d, r) if d > per else 1.0

        mean = -(-d // 32) * 32 + 32
        if self.records:  # a record per channel: 32 // rec_b records a sector, or rec_b / 32
            per = max(1, 32 // rec_b)
            return mean + 32 * -(-d // per) * hit(per) * max(1, rec_b // 32)
        box_per = max(1, 32 // element_size)
        code_per = max(1, 32 // code_b)
        return (mean + 2 * 32 * -(-d // box_per) * hit(box_per)
                + 32 * -(-d // code_per) * hit(code_per) * max(1, code_b // 32))

    def select_row_bytes(self, head_dim: int, element_size: int) -> int:
        """Summary bytes a select reads per row and step besides its pages: the channel
        choice's cached width sums of one page ([D] fp32; records: the page's whole records,
        where the width word lies)."""
        if self.records:
            return head_dim * 4 * record_words(element_size, self.page_size)
        return head_dim * 4
