"""Megatron-style tensor parallelism for the Llama-family model: who owns which slice.

`TensorParallel(rank, size)` is a parameter of the layers (None = one process, the model
exactly as without tensor parallelism). With it, rank r of `size` holds

* q/k/v and gate/up projections column-parallel: rows of its query heads
  [r*Hq/size, (r+1)*Hq/size), of its KV heads [r*Hkv/size, ...) and of its slice of the
  intermediate dimension (GQA groups stay whole: query head h reads KV head h // (Hq/Hkv));
* o and down projections row-parallel (the matching input columns), followed by one
  all-reduce each;
* the embedding and the LM head vocabulary-parallel: rows [r*V', min((r+1)*V', V)) with
  V' = ceil(V / size) (the last rank's rows past V are zero padding); lookup is masked and
  all-reduced, the logits of each rank's slice are gathered to rank 0 for sampling;
* norms replicated.

Collectives run on `group` (None: the default process group of torch.distributed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparseserve.config import ModelConfig

VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split dim 0 (out features)
_ROW = ("o_proj", "down_proj")  # split dim 1 (in features)


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: Any = None  # a torch.distributed ProcessGroup; None = the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        import torch.distributed as dist
        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """local [N, V'] fp32 (this rank's vocabulary slice) -> on rank 0 the full logits
        [N, vocab_size]; on other ranks `local` itself (not for sampling)."""
        import torch.distributed as dist
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=dist.get_global_rank(self.group, 0)
                    if self.group is not None else 0, group=self.group)
        if self.rank != 0:
            return local
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def check_tp_divisible(cfg: ModelConfig, size: int) -> None:
    """ValueError, saying what to do, unless `size` ranks can split the model evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {size}.")
    if size == 1:
        return
    wrong = [f"{what} = {n}" for what, n in (
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("num_attention_heads", cfg.num_attention_heads),
        ("intermediate_size", cfg.intermediate_size)) if n % size]
    if wrong:
        heads = cfg.num_key_value_heads
        fits = [d for d in range(1, heads + 1) if heads % d == 0
                and cfg.num_attention_heads % d == 0 and cfg.intermediate_size % d == 0]
        raise ValueError(
            f"tensor_parallel_size={size} must divide the model's {', '.join(wrong)}: each rank "
            "owns an equal share of the KV heads (and their query heads and MLP columns). "
            f"Use a tensor_parallel_size among {fits} for this model.")


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(first row, end row clipped to vocab_size, rows per rank incl. padding) of tp.rank."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


def shard_spec(name: str, full_shape: tuple[int, ...], cfg: ModelConfig,
               tp: TensorParallel) -> tuple[int, int, int] | None:
    """(dim, start, end) of the full checkpoint tensor `name` that rank tp.rank holds, or
    None when the tensor is replicated (norms)."""
    if name in VOCAB_PARALLEL:
        start, end, _ = vocab_shard(cfg.vocab_size, tp)
        return 0, start, end
    parts = name.split(".")
    kind = parts[-2] if len(parts) >= 2 else ""
    if kind in _COLUMN:
        dim = 0
    elif kind in _ROW and parts[-1] == "weight":
        dim = 1
    else:
        return None
    per = full_shape[dim] // tp.size
    return dim, tp.rank * per, (tp.rank + 1) * per


def take_shard(t: torch.Tensor, spec: tuple[int, int, int] | None) -> torch.Tensor:
    """The slice `spec` of a full tensor, as its own (contiguous) storage."""
    if spec is None:
        return t
    dim, start, end = spec
    return t.narrow(dim, start, end - start).contiguous()
