"""Frozen engine configuration.

`EngineConfig.resolve(...)` takes the user's knobs (vLLM names), loads the model's
architecture description, checks every value and returns frozen dataclasses that the
rest of the engine reads. Nothing changes a config after `resolve()`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (names follow Hugging Face's config.json)."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES' values: "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face's rope_scaling dict (only type "llama3" and "linear" change the frequencies)
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"  # dtype the checkpoint was saved in
    name: str = ""
    # Mistral v0.1-style sliding-window attention (None: full attention)
    sliding_window: int | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], name: str = "") -> "ModelConfig":
        """Build from a Hugging Face config.json dict; raise for unsupported architectures."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and model_type in SUPPORTED_ARCHITECTURES.values():
            arch = model_type
        if arch is None:
            raise ValueError(
                f"Unsupported model architecture {archs or model_type!r} in {name or 'config'}. "
                f"sparseserve runs Llama-family decoders: {sorted(SUPPORTED_ARCHITECTURES)}; "
                "use a checkpoint of one of these architectures."
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), Mapping):
            # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
            params = dict(cfg["rope_parameters"])
            rope_theta = params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            name=name,
            sliding_window=(int(cfg["sliding_window"]) if cfg.get("sliding_window")
                            and cfg.get("use_sliding_window", True) else None),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V bytes one token occupies across all layers and KV heads."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class LoadConfig:
    model: str  # path to an HF directory, a .gguf file, or a built-in dummy name
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    tokenizer: str | None = None


HOST_CHUNK_PAGES = 16  # 512 tokens at page_size 32: <= 1.6% rounding waste at 32k tokens


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 32  # tokens per page (one page = one layer, one KV head)
    num_pages: int = 0  # device pages per layer (resolved from the memory budget)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # two-tier cache: every page in host DRAM, num_pages device slots per layer cache them
    kv_offload: bool = False
    num_host_pages: int = 0
    h2d_method: str = "flash"  # "flash" (FlashH2D) | "memcpy" (one copy per page)
    d2h_method: str = "flash"  # "flash" (FlashD2H) | "memcpy" | "gpu-direct" | "copy-engine"
    eviction: str = "category-lru"  # | "lru"

    @property
    def saves_ordered_on_device(self) -> bool:
        """Prefill saves complete in CUDA-stream order (GPU-direct, per-page copies), so a
        later load can wait for them on the device; FlashD2H's CPU scatter completes only on
        the host."""
        return self.d2h_method != "flash"

    @property
    def chunk_pages(self) -> int:
        """Pages per allocation chunk of one (request, KV head) (KVCacheManager): host pages
        come in chunks of HOST_CHUNK_PAGES (a two-level page table, contiguous DRAM runs);
        device pages of the all-resident engine one by one (no rounding waste in HBM)."""
        return HOST_CHUNK_PAGES if self.kv_offload else 1


# layer-segmented prefill: the share of a step's injection budget that a step which could not
# use it (the next layer did not fit) carries to the next step (engine/scheduler.py)
INJECT_CREDIT_FRACTION = 0.25


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    # Layer-segmented prefill (SparseServe's maxInjectToken): prefill work per step in prompt
    # tokens x layers run; None = chunked prefill over all layers.
    max_inject_tokens: int | None = None
    # two-tier cache: admit requests while their estimated device working sets fit the slots
    working_set_control: bool = False
    working_set_window: int = 12  # decode steps a working set spans (SparseServe's w)


@dataclass(frozen=True)
class SparseConfig:
    """Dynamic sparse decode attention (DESIGN.md §4). algorithm "dense" = full attention."""

    algorithm: str = "dense"
    token_budget: int = 2048  # tokens attended per (request, layer, KV head), kept pages included
    sink_pages: int = 1  # first pages always attended
    # last pages (incl. the partial one) always attended; 2 measured best with sink 1 and no
    # dense layer (docs/results/fidelity.md; local 4 and 2 dense layers were within noise of it)
    local_pages: int = 2
    dense_layers: int = 0  # the first layers stay dense

    @property
    def enabled(self) -> bool:
        return self.algorithm != "dense"


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (DESIGN.md §10): each of tensor_parallel_size ranks owns
    num_key_value_heads / size KV heads; CacheConfig's page counts are per rank."""

    tensor_parallel_size: int = 1


# CUDA graphs of the runner (vLLM's names): whole decode steps only, or also the attention-free
# pieces of every layer for steps with prefill work (worker/piecewise_graphs.py)
CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "FULL")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    sparse: SparseConfig = field(default_factory=SparseConfig)
    device: str = "cpu"  # "cpu" | "cuda"
    dtype: str = "float32"  # compute dtype name of torch ("float32", "bfloat16", "float16")
    seed: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs
    cudagraph_mode: str = "FULL_DECODE_ONLY"  # CUDAGRAPH_MODES (unused when enforce_eager)
    async_scheduling: bool = False  # launch step N + 1 before reading step N's tokens
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    extra: Mapping[str, Any] = field(default_factory=dict)
    # engine.memory_plan.MemoryPlan: the device bytes of one rank, by component (EngineArgs
    # plans it; None for a config built by hand)
    memory_plan: Any = None

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
