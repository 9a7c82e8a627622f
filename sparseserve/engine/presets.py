"""Presets: the systems the papers compare (DESIGN.md §7), as defaults for EngineArgs.

A preset fills only the knobs the user left unset (None); anything given explicitly wins.
The ablation ladder of SparseServe's Figure 13 is expressible on top of them:

  SA        --preset sparse
  +Offload  --preset sparse-offload
  +FT       --preset sparse-offload --h2d-method flash --d2h-method gpu-direct
            (the paper's FlashD2H: --d2h-method flash)
  +WC       ... --working-set-control
  +LP       ... --layer-segmented-prefill          (= --preset sparseserve)
"""
from __future__ import annotations

# the sparse algorithm of the sparse presets (SparseServe evaluates with ArkVale)
SPARSE_PRESET_ALGORITHM = "arkvale"

PRESETS: dict[str, dict[str, object]] = {
    # vLLM: full attention, every page in HBM, chunked prefill, token / sequence limits
    "dense": dict(sparse_algorithm="dense", kv_offload=False),
    # vLLM-S: sparse decode, every page in HBM
    "sparse": dict(sparse_algorithm=SPARSE_PRESET_ALGORITHM, kv_offload=False),
    # vLLM-SO: sparse decode over DRAM + an HBM LRU cache, per-page copies, no batch control
    "sparse-offload": dict(sparse_algorithm=SPARSE_PRESET_ALGORITHM, kv_offload=True,
                           h2d_method="memcpy", d2h_method="memcpy", eviction="lru",
                           working_set_control=False, layer_segmented_prefill=False),
    # the full system: FlashH2D, GPU-direct saves, category LRU, working-set-aware batch
    # control, layer-segmented prefill. Saves are GPU-direct writes from a side stream, not the
    # paper's FlashD2H (staging + CPU scatter threads): end to end on the H200 (mix40, same
    # run) GPU-direct took 29.2 s vs FlashD2H's 31.4 s, p99 TBT 120 vs 171 ms — the scatter
    # threads contend for the GIL with the step's launches (system.md, fifth session)
    "sparseserve": dict(sparse_algorithm=SPARSE_PRESET_ALGORITHM, kv_offload=True,
                        h2d_method="flash", d2h_method="gpu-direct", eviction="category-lru",
                        working_set_control=True, layer_segmented_prefill=True),
}

# what a knob is when neither the user nor a preset set it
BASE_DEFAULTS: dict[str, object] = dict(
    sparse_algorithm="dense", kv_offload=False, h2d_method="flash", d2h_method="flash",
    eviction="category-lru", working_set_control=None, layer_segmented_prefill=None)

# knobs that only act on the two-tier cache
OFFLOAD_ONLY = ("h2d_method", "d2h_method", "eviction", "working_set_control",
                "kv_offloading_size")


def preset_help() -> str:
    """One line per preset: what it sets (for `--help`)."""
    lines = []
    for name, values in PRESETS.items():
        lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    return "; ".join(lines)


def apply_preset(preset: str | None, given: dict[str, object]) -> dict[str, object]:
    """-> the preset-controlled knobs resolved: `given` (None = unset) over the preset over
    the base defaults. Raises ValueError for an unknown preset."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
    out = dict(BASE_DEFAULTS)
    if preset is not None:
        out.update(PRESETS[preset])
    out.update({k: v for k, v in given.items() if v is not None})
    return out
