"""FlashD2H's staging ring holds two steps of prefill saves (the fence lags one step)."""
from sparseserve.worker.pinned_host import staging_ring_bytes

MiB, GiB = 1 << 20, 1 << 30


def step_save_bytes(token_layers: int, kv_heads: int, head_dim: int = 128, esz: int = 2) -> int:
    return token_layers * kv_heads * head_dim * esz * 2


def test_mha_step_gets_two_steps_of_ring():
    # LWM-7B: 32 KV heads, 65,536 token-layers a step = 1 GiB of K + V per step
    one = step_save_bytes(65536, 32)
    assert one == GiB
    ring = staging_ring_bytes(one)
    assert ring == 2 * GiB and ring % (64 * MiB) == 0


def test_small_steps_keep_the_floor_and_huge_ones_the_cap():
    assert staging_ring_bytes(step_save_bytes(65536, 8)) == GiB      # Llama-3-8B: 256 MiB/step
    assert staging_ring_bytes(0) == GiB
    assert staging_ring_bytes(100 * GiB) == 8 * GiB


def test_rounded_up_to_64_mib():
    ring = staging_ring_bytes(GiB // 2 + 3 * MiB)   # 2 x = 1 GiB + 6 MiB
    assert ring == GiB + 64 * MiB
