"""The record layout of ``keycode2-sparq``'s summaries (``sparse/keycode_sparq.py``, the default;
``records = False`` keeps the first layout, ``kernels/ref_sparq.py``): one record per (page,
channel) holding everything a select reads of that channel, so the R channels a row decodes
cost one record each instead of four scattered pieces.

Why. A select decodes the same R (16) channels of every page of a row, chosen per query: with
the box (``kmin``, ``kmax`` [D] each) and the channel-major codes in separate rows, a page's R
chosen channels touch ~7.1 of the 8 32-byte sectors of each box row and ~13.4 of the 32 code
sectors (D 128, bf16, page 32): ~28 scattered sectors. In a record the channel's ``lo``, ``hi``
and code words share 16 bytes, two records a sector: ~15 sectors for 16 channels.

Record of channel c of a page (int32 words; ``rec`` [S, D * NR] int32, record c at words
``c * NR .. c * NR + NR - 1`` of the page's row; the engine allocates the rows in the KV dtype,
so that they carry the box's type, and reads them as int32 words):

* box words (``BOXW`` = 1 for a 16-bit KV dtype, 2 for fp32): ``lo``, ``hi`` in the KV dtype,
  ``lo`` first (for bf16: ``lo`` the low half of word 0, so ``word << 16`` is ``lo`` as fp32,
  ``word & 0xFFFF0000`` is ``hi``);
* ``page_size / 16`` code words: the channel's 2-bit codes, token t at bits ``2 * (t % 16)`` of
  word ``t // 16`` (the first layout's channel-major words);
* one fp32 word: the row's width sum up to this page (the first layout's ``wsum``: per-page
  state of the channel choice, ``kernels/sparq_codes.py``; -1 = not known yet);
* zero padding to ``NR`` = a power of two, so that a record is one aligned vector load.

Bytes per page at D 128, page 32: bf16 ``NR`` 4 (16 B a record): 2,048 B of records + the
int8 mean and its scale (132 B) = 2,180 B, exactly the first layout's (the width sums fill the
padding); fp32 KV or page 16 / 64 pad (NR 8, 8-word records at fp32 page 32).

Interleaved (``interleave``): the same records in chunks of RI pages, channel-major within a
chunk — record (p, c) at word ``((p // RI) * D + c) * RI * NR + (p % RI) * NR`` — so that one
channel's records of a chunk's pages are contiguous; kernels address either layout through
``sparq_tiles.rec_elem`` given the un-interleaved views' strides and RI.

``record_views`` gives the first layout's tensors as strided views of the records, so every
reference and the generic kernels read either layout through channel strides; the fused
select's score phases (``sparq_stream``, ``sparq_tiles``) load whole records where ``NR`` is 4.
"""
from __future__ import annotations

import torch


def box_words(element_size: int) -> int:
    """int32 words of a record's (lo, hi) pair in a KV dtype of ``element_size`` bytes."""
    return max(1, 2 * element_size // 4)


def record_words(element_size: int, page_size: int) -> int:
    """NR: words per record (box, page_size / 16 code words, the width word, padding)."""
    n = box_words(element_size) + page_size // 16 + 1
    return 1 << (n - 1).bit_length()


def pack_records(lo: torch.Tensor, hi: torch.Tensor, codes: torch.Tensor,
                 nr: int) -> torch.Tensor:
    """Records of N pages: lo, hi [N, D] (the KV dtype), codes [N, D, page_size / 16] int32
    channel-major -> [N, D * nr] int32 with every width word -1 (not known yet)."""
    n, d = lo.shape
    box = torch.stack([lo, hi], -1).view(torch.int32)                       # [N, D, BOXW]
    width = torch.full((n, d, 1), -1.0, device=lo.device).view(torch.int32)
    pad = torch.zeros(n, d, nr - box.shape[-1] - codes.shape[-1] - 1, dtype=torch.int32,
                      device=lo.device)
    return torch.cat([box, codes, width, pad], -1).view(n, d * nr)


def record_views(rec: torch.Tensor, dtype: torch.dtype, head_dim: int,
                 page_size: int) -> dict[str, torch.Tensor]:
    """The first layout's tensors as views of ``rec`` [S, D * NR] int32 (no copy; writes go
    to the records): ``kmin``, ``kmax`` [S, D] in ``dtype`` (channel stride NR * 4 / itemsize),
    ``codes`` [S, D, page_size / 16] int32 (channel stride NR), ``wsum`` [S, D] fp32 (channel
    stride NR)."""
    s, d, nwc = rec.shape[0], head_dim, page_size // 16
    nr, bw = rec.shape[1] // d, box_words(dtype.itemsize)
    words = rec.view(s, d, nr)
    box = words.view(dtype).view(s, d, -1)                # [S, D, NR * 4 / itemsize]
    return {"kmin": box[:, :, 0], "kmax": box[:, :, 1], "codes": words[:, :, bw:bw + nwc],
            "wsum": words.view(torch.float32)[:, :, bw + nwc]}


def rec_kind(dtype: torch.dtype) -> int:
    """The kernels' ``REC`` constant for records with a box in ``dtype``: 1 bf16, 2 fp16,
    3 fp32 (0: no records)."""
    return {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}[dtype]


def interleave(words: torch.Tensor, nr: int, ri: int) -> torch.Tensor:
    """Records in their pages' rows ``words`` [S, D * NR] int32 (S a multiple of ``ri``) ->
    the same records in chunks of ``ri`` pages, channel-major within a chunk: record (p, c) at
    flat word ``((p // ri) * D + c) * ri * NR + (p % ri) * NR`` (``sparq_tiles.rec_word``),
    same shape. A chunk's pages are the allocation chunk of one (request, KV head) (host
    pages come in aligned chunks of 16), so a select's sub-tile of 16 consecutive entries
    reads each chosen channel of its 16 pages as one contiguous run."""
    s, w = words.shape
    d = w // nr
    return words.view(s // ri, ri, d, nr).transpose(1, 2).contiguous().view(s, w)


def deinterleave(words: torch.Tensor, nr: int, ri: int) -> torch.Tensor:
    """``interleave``'s inverse: the records back in their pages' rows (a copy)."""
    s, w = words.shape
    d = w // nr
    return words.view(s // ri, d, ri, nr).transpose(1, 2).contiguous().view(s, w)


def record_word_offsets(rows: torch.Tensor, d: int, nr: int, ri: int) -> torch.Tensor:
    """Flat int32-word offsets [N, D * NR] of the records of pages ``rows`` [N] (int64) in
    ``interleave``'s layout (``ri`` 1: the rows' own words): where ``index`` writes a page."""
    c = torch.arange(d, device=rows.device)
    w = torch.arange(nr, device=rows.device)
    base = (rows // ri)[:, None] * (ri * d * nr) + (rows % ri)[:, None] * nr + c[None, :] * (ri * nr)
    return (base[:, :, None] + w[None, None, :]).reshape(rows.shape[0], d * nr)
