"""`sparseserve eval fidelity` with evaluation variants of the channel key codes registered
(``sparse/keycode_channels.py``; the CLI knows only the engine's algorithms):

* ``keycode2-c4-var`` / ``keycode2-c8-var`` — the coded channels chosen by within-page
  variance instead of width (max - min);
* ``keycode2-c4-q`` — chosen by within-page variance times the energy of the page's filling
  queries (rotate-half pairs summed), the query-aware estimate of the logit error removed;
* ``keycode2-c4-f`` / ``keycode2-c8-f`` — the page mean in the KV dtype (2 D bytes at bf16)
  instead of int8 times a per-page absmax scale (D + 4 bytes). Until 2026-12-03 the
  registered keycode2-c4 / -c8 had the float mean and this variant was the int8 one, named
  ``-i8``: the JSON rows of docs/results/data/fidelity_keycode_channels_*.json carry the old
  names (``keycode2-c4`` = float mean, ``keycode2-c4-i8`` = today's keycode2-c4);
* ``keycode2-sparq-r16`` / ``keycode2-sparq-r8`` — SparQ-style runtime channel choice (issue
  11): keycode2's codes on every channel (its kmin / kmax / codes) plus the page mean (int8
  times a per-page absmax scale, as keycode2-c4's); a token's approximate logit is
  ``q . mean + q[R] . (k^[R] - mean[R])`` with ``R`` the channels where the query group has
  the largest ``sum_g |q_gc|`` (per request, layer and KV head: every page of a row uses the
  same channels, so a GPU select is one dense dot per (request, head) over the pages' codes on
  those channels, reading R / D of keycode2's code bytes). R = D is keycode2 exactly.
  ``keycode2-sparq-w16`` / ``-w8``: the channels by ``sum_g |q_gc|`` times the channel's
  min-max width summed over the row's pages before its last (a per-request, per-head
  statistic, e.g. kept up to date at index time: still one channel set for every page).

They are real algorithms with their own summaries (registered here, evaluated like any other,
fast mode through ``KeyCodes.approx_keys``).

    nice -n 5 python benchmarks/fidelity_keycode_channels.py --lengths 8192 --budgets 512 2048 \\
        --algorithms keycode2-c4 keycode2-c4-var keycode2-c4-f --num-texts 2 --tail 256 \\
        --sweep-algorithms keycode2-c4 --sweep-settings s1l2d0 --no-needle --no-plot --out OUT
"""
from __future__ import annotations

import sys

import torch

from sparseserve.bench import fidelity_cli, fidelity_tail
from sparseserve.bench.fidelity_shared import SharedText
from sparseserve.sparse.base import SparseAlgorithm, register
from sparseserve.sparse.keycode_channels import KeyCodeChannels
from sparseserve.sparse.keycodes import KeyCodes


class ByVariance(KeyCodeChannels):
    def channel_worth(self, k, ok, mean, width, queries):
        """The within-page variance of each channel."""
        return torch.where(ok, (k - mean.unsqueeze(1)) ** 2, 0.0).sum(1)


class ByQueryEnergy(ByVariance):
    uses_queries = True

    def channel_worth(self, k, ok, mean, width, queries):
        """Variance x the query energy there, estimated from the queries that filled the page
        (rotate-half RoPE turns channel c with c + D/2: their summed energy is the
        position-free part): the expected squared logit error a channel's codes remove."""
        var = super().channel_worth(k, ok, mean, width, queries)
        if queries is None:
            return var
        qe = queries.float().pow(2).sum(1)                            # [N, D]
        return var * (qe + qe.roll(k.shape[-1] // 2, dims=1))


register("keycode2-c4-q")(type("KeyCode2C4Query", (ByQueryEnergy,), {"channel_divisor": 4}))
for _div in (4, 8):
    register(f"keycode2-c{_div}-var")(type(f"KeyCode2C{_div}Var", (ByVariance,),
                                           {"channel_divisor": _div}))
    register(f"keycode2-c{_div}-f")(type(f"KeyCode2C{_div}Float", (KeyCodeChannels,),
                                         {"channel_divisor": _div, "int8_mean": False}))


class KeyCodeSparQ(SparseAlgorithm):
    """keycode2's summaries plus the int8 page mean; per query the ``channels`` coded channels
    with the largest group |q| get the decoded deviations, the others the page mean. Not a
    KeyCodes subclass (the harness would score it as keycode2 from the shared text): keycode2's
    index / decoding / page-mass methods are borrowed as functions."""

    summary_names = ("kmin", "kmax", "codes", "kmean", "kscale")
    bits = 2
    channels = 16                 # R; None = every channel
    fused_select = False          # the generic select over score()

    levels = KeyCodes.levels
    approx_keys = KeyCodes.approx_keys          # keycode2's decoded keys [..., ps, D]
    from_token_logits = KeyCodes.from_token_logits

    def summary_shapes(self, head_dim):
        return dict(KeyCodes.summary_shapes(self, head_dim), kmean=(head_dim,), kscale=(1,))

    def summary_dtypes(self):
        return {"codes": torch.int32, "kmean": torch.int8, "kscale": torch.float32}

    def index(self, k_cache, page_ids, num_tokens, summaries, queries):
        KeyCodes.index(self, k_cache, page_ids, num_tokens, summaries, queries)
        live = page_ids >= 0
        rows = torch.where(live, page_ids, summaries["kmean"].shape[0] - 1).long()
        k = k_cache[torch.where(live, page_ids, 0).long()].float()   # [N, ps, D]
        ok = torch.arange(k.shape[1]).view(1, -1, 1) < num_tokens.view(-1, 1, 1)
        mean = torch.where(ok, k, 0.0).sum(1) / num_tokens.clamp(min=1).view(-1, 1).float()
        amax = mean.abs().amax(1, keepdim=True).clamp(min=1e-30)     # keycode2-c4's int8 mean
        summaries["kscale"][rows] = amax / 127
        summaries["kmean"][rows] = (mean / amax * 127).round().to(summaries["kmean"].dtype)

    def page_mean(self, summaries, rows):
        return summaries["kmean"][rows].float() * summaries["kscale"][rows].float()

    by_width = False              # weight |q| by the row's summed page widths per channel

    def chosen(self, qg: torch.Tensor, width: torch.Tensor | None = None) -> torch.Tensor:
        """qg [B, Hkv, G, D] -> [B, Hkv, R] the channels with the largest sum_g |q_gc|
        (times ``width`` [B, Hkv, D] with ``by_width``)."""
        d = qg.shape[-1]
        r = d if self.channels is None else min(self.channels, d)
        w = qg.abs().sum(2)
        if self.by_width:
            w = w * width
        return w.topk(r, dim=-1).indices

    def row_width(self, summaries, rows, num_pages):
        """[B, Hkv, D]: kmax - kmin summed over each row's full pages before its last (rows
        [B, Hkv, W] or, shared, [Hkv, W]; the last page, always kept, may be partial);
        None unless ``by_width``."""
        if not self.by_width:
            return None
        w = rows.shape[-1]
        ok = torch.arange(w).view(1, 1, w) < num_pages.long().unsqueeze(-1) - 1
        wid = summaries["kmax"][rows].float() - summaries["kmin"][rows].float()
        if rows.dim() == 2:
            return torch.einsum("bhw,hwd->bhd", ok.float(), wid)
        return (wid * ok.unsqueeze(-1)).sum(2)

    def token_logits(self, qg, mean, kh, shared: bool, width=None):
        """Scaled approximate logits [B, Hkv, G, W, ps]: q . mean + q[R] . (k^ - mean)[R].
        mean [B, Hkv, W, D] / kh [B, Hkv, W, ps, D] (shared: [Hkv, W, D] / [Hkv, W, ps, D],
        one text's pages for every row)."""
        m = torch.zeros_like(qg[:, :, :1]).scatter_(-1, self.chosen(qg, width).unsqueeze(2), 1.0)
        qm = qg * m                                                    # [B, Hkv, G, D]
        dev = kh - mean.unsqueeze(-2)
        if shared:
            x = (torch.einsum("bhgd,hwd->bhgw", qg, mean).unsqueeze(-1)
                 + torch.einsum("bhgd,hwtd->bhgwt", qm, dev))
        else:
            x = (torch.einsum("bhgd,bhwd->bhgw", qg, mean).unsqueeze(-1)
                 + torch.einsum("bhgd,bhwtd->bhgwt", qm, dev))
        return x * qg.shape[-1] ** -0.5

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        b, hq, d = q.shape
        hkv, w = page_table.shape[1:]
        ok = torch.arange(w).view(1, 1, w) < num_pages.long().unsqueeze(-1)
        ids = torch.where(ok, page_table.long(), 0)
        qg = q.float().view(b, hkv, hq // hkv, d)
        x = self.token_logits(qg, self.page_mean(summaries, ids), self.approx_keys(summaries, ids),
                              False, self.row_width(summaries, ids, num_pages))
        return self.from_token_logits(x, num_pages, d ** -0.5)


def shared_sparq_class(cls):
    """The shared-text twin (fast mode): the text's pages decoded once for all rows; same math
    as score()."""

    class SharedSparQ(cls):
        shared: SharedText | None = None

        def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
            sh = self.shared
            if sh is None or not sh.covers(page_table, num_pages):
                return super().score(q, page_table, num_pages, last_page_len, summaries,
                                     k_cache)
            b, hq, d = q.shape
            w = page_table.shape[2]
            rows = sh.page_rows(w)
            qg = q.float().view(b, sh.hkv, hq // sh.hkv, d)
            x = self.token_logits(qg, self.page_mean(summaries, rows),
                                  self.approx_keys(summaries, rows), True,
                                  self.row_width(summaries, rows, num_pages))
            return self.from_token_logits(x, num_pages, d ** -0.5)

    SharedSparQ.__name__ = f"Shared{cls.__name__}"
    return SharedSparQ


fidelity_tail.register_fast(KeyCodeSparQ, shared_sparq_class)
for _r in (8, 16, 32, 64):
    register(f"keycode2-sparq-r{_r}")(type(f"KeyCode2SparQR{_r}", (KeyCodeSparQ,),
                                          {"channels": _r}))
for _r in (8, 16):
    register(f"keycode2-sparq-w{_r}")(type(f"KeyCode2SparQW{_r}", (KeyCodeSparQ,),
                                          {"channels": _r, "by_width": True}))


def main(argv=None) -> int:
    return fidelity_cli.main(["fidelity"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
