"""The atomic counting sort against a stable sort: same key sequence, every index once."""
import pytest
import torch

from sparseserve.kernels.bucket_order import bucket_order


@pytest.mark.parametrize("n", [1, 17, 97, 4097])
def test_bucket_order_matches_sorted_keys(n):
    torch.manual_seed(n)
    key = torch.randint(0, 130, (n,))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = bucket_order(key.to(dev), 130).cpu()
    assert sorted(out.tolist()) == list(range(n))
    assert torch.equal(key[out], torch.sort(key, descending=True).values)
