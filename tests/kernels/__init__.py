"""Shared helpers of the kernel tests."""
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _on_dev(fn):
    """Run a Triton entry point on DEV (Triton's interpreter on CPU-only machines): CPU tensor
    arguments travel to DEV and back (in-place outputs included); results come back on CPU."""
    if DEV == "cpu":
        return fn

    def run(*args, **kwargs):
        pairs = []

        def mv(a):
            if not torch.is_tensor(a) or a.device.type == DEV:
                return a
            d = a.to(DEV)
            pairs.append((a, d))
            return d

        res = fn(*[mv(a) for a in args], **{k: mv(v) for k, v in kwargs.items()})
        for a, d in pairs:
            a.copy_(d)
        for a, d in pairs:
            if torch.is_tensor(res) and res.data_ptr() == d.data_ptr():
                return a
        return res.cpu() if torch.is_tensor(res) and pairs else res

    return run
