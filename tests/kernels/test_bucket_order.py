"""The atomic counting sort against a stable sort: same key sequence, every index once."""
import pytest
import torch

from sparseserve.kernels.bucket_order import bucket_order


@pytest.mark.parametrize("n", [1, 17, 97, 4097])
def test_bucket_order_matches_sorted_keys(device, n):
    torch.manual_seed(n)
    key = torch.randint(0, 130, (n,)).to(device)
    out = bucket_order(key, 130)
    assert out.device == key.device
    assert torch.equal(out.sort().values, torch.arange(n, device=device))
    assert torch.equal(key[out], torch.sort(key, descending=True).values)
