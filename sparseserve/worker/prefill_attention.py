"""Causal attention of a whole prompt (a chunk starting at position 0) on cuDNN, padded to a
small set of lengths whose execution plans are built once, at start-up.

Why: on the H200 (torch 2.11) cuDNN's SDPA kernel is ~2x faster than flash at 2k-23k tokens
(0.11 vs 0.22 ms at 2,267 tokens, 3.2 vs 5.9 ms at 15,452, Llama-3-8B heads;
docs/results/data/prefill_attention_session5.json), but cuDNN builds an execution plan per
new shape, 42-75 ms of host time each, and every prompt has its own length — so in serving it
cost more than it saved (mix40 steps that admitted a new prompt: 202 vs 122 ms). Padding at the
end is exact for causal attention: query i sees keys <= i < n, so the padded keys are never
seen by a real query and the padded query rows are dropped. Buckets are 8 per octave (at most
12.5% padding, >= 512 tokens), so a 24k model needs 28 plans (~2 s at start-up) and 128k 48.

Layer-segmented prefill (the sparseserve preset) runs every prompt this way, once per layer;
chunks that continue a prefix keep flash (forward_context.py).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger(__name__)

MIN_BUCKET = 512
STEP_SHIFT = 4  # step = 2^(k-4) for lengths in (2^(k-1), 2^k]: 8 buckets per octave


def bucket_length(n: int) -> int:
    """-> the padded length for an n-token prompt: a multiple of max(MIN_BUCKET, 2^(k-4))
    where 2^k is the smallest power of two >= n (so under 12.5% padding above 4k tokens)."""
    if n < 1:
        raise ValueError(f"prompt length must be >= 1, got {n}")
    step = max(MIN_BUCKET, 1 << max(0, (n - 1).bit_length() - STEP_SHIFT))
    return -(-n // step) * step


def bucket_lengths(max_len: int) -> list[int]:
    """-> every bucket a prompt of 1..max_len tokens can fall in, ascending."""
    out, n = [], 1
    while n <= max_len:
        b = bucket_length(n)
        out.append(b)
        n = b + 1
    return out


class PaddedCausalAttention:
    """Causal SDPA over a whole prompt, padded to its bucket, on `backend`, for the buckets
    warmed up (plans built) — longer prompts are declined (None) so that no plan is ever built
    while serving. The backend is a parameter so the padding is testable on CPU (MATH)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device,
                 backend: SDPBackend = SDPBackend.CUDNN_ATTENTION) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.dtype, self.device, self.backend = dtype, device, backend
        self.max_bucket = 0  # buckets up to this length have a plan

    @classmethod
    def for_cuda(cls, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device,
                 max_len: int) -> PaddedCausalAttention | None:
        """cuDNN plans for every bucket up to max_len, built now; None off CUDA, without
        cuDNN, or when not even the first bucket could be planned (flash serves then)."""
        if device.type != "cuda" or not torch.backends.cudnn.is_available():
            return None
        attn = cls(num_heads, num_kv_heads, head_dim, scale, dtype, device)
        return attn if attn.warm_up(max_len) else None

    def warm_up(self, max_len: int) -> list[int]:
        """Run every bucket up to max_len once (builds its plan). Stops at the first bucket that
        fails (out of memory, backend unavailable); -> the buckets warmed."""
        warmed: list[int] = []
        for b in bucket_lengths(max_len):
            try:
                self._run(*self._buffers(b))
            except (RuntimeError, torch.OutOfMemoryError) as e:
                logger.warning("cuDNN prefill attention: warm-up stopped at %d tokens (%s); "
                               "longer prompts use flash", b, str(e).splitlines()[0][:120])
                break
            warmed.append(b)
            self.max_bucket = b
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return warmed

    def __call__(self, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor | None:
        """q [n, Hq, D], k/v [n, Hkv, D] (a prompt's rows from position 0) -> causal attention
        [n, Hq, D], or None when n is beyond the warmed buckets."""
        n = q.shape[0]
        b = bucket_length(n)
        if b > self.max_bucket:
            return None
        # zero padding (padded keys are masked, but 0 * NaN in P @ V would not be), one
        # launch per tensor: the layout the plans were built with ([b, H, D] contiguous)
        qb, kb, vb = (F.pad(x, (0, 0, 0, 0, 0, b - n)) for x in (q, k, v))
        return self._run(qb, kb, vb)[:n]

    def _buffers(self, b: int, fill: bool = True):
        """-> q [b, Hq, D], k/v [b, Hkv, D] (the layout every call uses: one plan per bucket)."""
        make = torch.zeros if fill else torch.empty
        kw = dict(dtype=self.dtype, device=self.device)
        return (make(b, self.num_heads, self.head_dim, **kw),
                make(b, self.num_kv_heads, self.head_dim, **kw),
                make(b, self.num_kv_heads, self.head_dim, **kw))

    def _run(self, qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
        gqa = {"enable_gqa": True} if self.num_heads != self.num_kv_heads else {}
        with sdpa_kernel([self.backend]):
            out = F.scaled_dot_product_attention(
                qb.transpose(0, 1).unsqueeze(0), kb.transpose(0, 1).unsqueeze(0),
                vb.transpose(0, 1).unsqueeze(0), is_causal=True,
                scale=self.scale, **gqa)
        return out[0].transpose(0, 1)  # [b, Hq, D]
