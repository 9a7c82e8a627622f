"""Device memory sizing of one rank: what the GPUs have free, the parameters a rank holds and
the activations of the largest step (EngineArgs subtracts both from the budget to size the
KV cache)."""
from __future__ import annotations

from sparseserve.config import ModelConfig

GiB = 1 << 30


def gpu_memory(tp: int = 1) -> tuple[int, int]:
    """(free, total) bytes of the GPU with the least free memory among the tp ranks' GPUs
    (CUDA devices 0..tp-1). With tp > 1 the engine process runs no model: NVML answers
    without creating a CUDA context here; without NVML (pynvml) torch.cuda.mem_get_info
    does, at the cost of a context on each GPU in this process."""
    import torch

    if tp == 1:
        return torch.cuda.mem_get_info()
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            infos = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(
                torch.cuda._get_nvml_device_index(i))) for i in range(tp)]
        finally:
            pynvml.nvmlShutdown()
        mems = [(int(m.free), int(m.total)) for m in infos]
    except Exception:  # noqa: BLE001 - no NVML: ask the CUDA runtime
        mems = [torch.cuda.mem_get_info(i) for i in range(tp)]
    return min(f for f, _ in mems), min(t for _, t in mems)


def param_count(mc: ModelConfig, tp: int = 1) -> int:
    """Parameters one of tp ranks holds (model/parallel.py): the projections split tp ways,
    the embedding and an untied LM head ceil(vocab / tp) rows each, the norms whole."""
    h, i, d = mc.hidden_size, mc.intermediate_size, mc.head_dim
    attn = h * d * (2 * mc.num_attention_heads + 2 * mc.num_key_value_heads) // tp
    layer = attn + 3 * h * i // tp + 2 * h
    rows = -(-mc.vocab_size // tp)
    head = 0 if mc.tie_word_embeddings else rows * h
    return mc.num_hidden_layers * layer + rows * h + head + h


def activation_bytes(mc: ModelConfig, batched_tokens: int, num_seqs: int, tp: int = 1) -> int:
    """Activations of the largest step on one rank: the hidden-size buffers (whole on every
    rank), its 1/tp of the MLP buffers, fp32 logits of the batch (rank 0 gathers the whole
    vocabulary, and every rank gets rank 0's page counts), plus 2 GiB of slack (CUDA context,
    allocator, collectives' buffers)."""
    return batched_tokens * (mc.hidden_size * 8 + mc.intermediate_size * 6 // tp) \
        + num_seqs * mc.vocab_size * 12 + 2 * GiB
