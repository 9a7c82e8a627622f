"""Next-token distribution metrics: sparse vs dense logits at the same positions."""
from __future__ import annotations

import torch

CONFIDENT_MARGIN = 1.0  # dense's top-2 logit margin that makes a position "confident"


def compare_logits(dense: torch.Tensor, sparse: torch.Tensor,
                   margin: float = CONFIDENT_MARGIN) -> dict:
    """dense, sparse [N, vocab] logits -> top-1 agreement (all positions and confident ones),
    mean KL(dense || sparse) in nats, and counts."""
    dense, sparse = dense.float(), sparse.float()
    agree = dense.argmax(-1) == sparse.argmax(-1)
    top2 = dense.topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) >= margin
    lp_d = torch.log_softmax(dense, -1)
    lp_s = torch.log_softmax(sparse, -1)
    kl = (lp_d.exp() * (lp_d - lp_s)).sum(-1).clamp(min=0)
    n_conf = int(confident.sum())
    return {
        "top1": float(agree.float().mean()),
        "top1_confident": float(agree[confident].float().mean()) if n_conf else None,
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "positions": int(agree.numel()),
        "confident_positions": n_conf,
        "agree_count": int(agree.sum()),
        "agree_confident_count": int(agree[confident].sum()),
    }


def pool(results: list[dict]) -> dict:
    """Pool per-text metric dicts: position-weighted top-1 / KL, layer-weighted recall."""
    n = sum(r["positions"] for r in results)
    nc = sum(r["confident_positions"] for r in results)
    out = {
        "top1": sum(r["agree_count"] for r in results) / n,
        "top1_confident": (sum(r["agree_confident_count"] for r in results) / nc) if nc else None,
        "kl": sum(r["kl"] * r["positions"] for r in results) / n,
        "kl_max": max(r["kl_max"] for r in results),
        "positions": n,
        "confident_positions": nc,
        "texts": len(results),
    }
    rec = [r for r in results if r.get("recall") is not None]
    out["recall"] = sum(r["recall"] for r in rec) / len(rec) if rec else None
    out["mass"] = sum(r["mass"] for r in rec) / len(rec) if rec else None
    return out
