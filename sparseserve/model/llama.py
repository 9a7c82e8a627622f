"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2).

Parameter names equal Hugging Face's, so a state dict from any loader drops straight in.
The model knows nothing about pages: attention calls `ctx.attention(layer, q, k, v)`, where
`ctx` is the worker's forward context for the current step (stores KV, attends over pages).
The forward pass is split into `embed`, `run_layers(l0, l1)` and `compute_logits` so a
request can run a sub-range of layers in one step and resume later (layer-segmented prefill).

Tensor parallelism is a parameter of the layers: with `tp` (model/parallel.py) each module
holds its rank's shard (heads, MLP columns, vocabulary rows) under the same parameter names,
and `weight_shard` tells the loaders which slice of each checkpoint tensor to read. tp=None
builds exactly the single-process model.
"""
from __future__ import annotations

from typing import Iterable, Protocol

import torch
from torch import nn

from sparseserve.config import ModelConfig
from sparseserve.model.cpu_linear import linear, pack
from sparseserve.model.layers import (GatedMLP, RMSNorm, RotaryEmbedding, fuse_linears,
                                      fused_ok, rotate)
from sparseserve.model.parallel import (VOCAB_PARALLEL, TensorParallel, shard_spec,
                                        take_shard, vocab_shard)


class AttentionContext(Protocol):
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (RoPE applied) -> [T, Hq, D]."""


class LlamaAttention(nn.Module):
    """With tp: this rank's Hq/tp query and Hkv/tp KV heads; o_proj then all-reduce."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        n = 1 if tp is None else tp.size
        self.num_heads = cfg.num_attention_heads // n
        self.num_kv_heads = cfg.num_key_value_heads // n
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        with torch.no_grad():  # q, k, v: views of one weight, one GEMM
            fuse_linears(self, "qkv", [self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext, residual: torch.Tensor | None = None,
                fused: bool = False) -> torch.Tensor:
        # x [T, hidden] -> [T, hidden] (+ residual: fused into the O projection on the CPU)
        # cos_sin: RotaryEmbedding.cos_sin of the tokens' positions (once per step)
        # fused: RoPE in place in one Triton launch (kernels/fused_layer_ops.py)
        q, k, v = self.project_qkv(x, cos_sin, fused)
        out = ctx.attention(self.layer, q, k, v).reshape(x.shape[0], -1)  # [T, Hq * D]
        return self.project_out(out, residual)

    def project_qkv(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                    fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k, v [T, Hkv, D], RoPE applied to q and k (views
        of one GEMM's output while the q/k/v weights alias their fused buffer). `fused`: RoPE
        in place in one Triton launch (`fused_qkv`)."""
        if fused:
            return self.split_qkv(self.fused_qkv(x, cos_sin))
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if fused_ok(self.qkv_weight, [self.q_proj, self.k_proj, self.v_proj]):
            qkv = linear(x, self.qkv_weight, self.qkv_bias).view(t, hq + 2 * hkv, d)
            qk = rotate(qkv[:, :hq + hkv], cos_sin)  # q and k in one rotation
            return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]
        q = rotate(linear(x, self.q_proj.weight, self.q_proj.bias).view(t, hq, d), cos_sin)
        k = rotate(linear(x, self.k_proj.weight, self.k_proj.bias).view(t, hkv, d), cos_sin)
        return q, k, linear(x, self.v_proj.weight, self.v_proj.bias).view(t, hkv, d)

    def fused_qkv(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The fused path's projection: x [T, hidden] -> qkv [T, Hq + 2 Hkv, D] (q heads, k,
        v), RoPE applied in place to q and k in one Triton launch."""
        t, d = x.shape[0], self.head_dim
        projs = [self.q_proj, self.k_proj, self.v_proj]
        if fused_ok(self.qkv_weight, projs):
            qkv = linear(x, self.qkv_weight, self.qkv_bias).view(t, -1, d)
        else:  # the views were replaced (e.g. by .to()): three GEMMs
            qkv = torch.cat([linear(x, p.weight, p.bias).view(t, -1, d) for p in projs], 1)
        _rotary_in_place(qkv[:, :self.num_heads + self.num_kv_heads], cos_sin)
        return qkv

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, Hq + 2 Hkv, D] -> views q [T, Hq, D], k, v [T, Hkv, D]."""
        hq, hkv = self.num_heads, self.num_kv_heads
        return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]

    def project_out(self, out: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The O projection of attention's out [T, Hq * D] (+ residual) -> [T, hidden]; with
        tp the all-reduce before the residual add."""
        if self.tp is None:
            return linear(out, self.o_proj.weight, residual=residual)
        out = self.tp.all_reduce(linear(out, self.o_proj.weight))
        return out if residual is None else residual + out


def _rotary_in_place(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`rotate`'s contract, in place in one Triton launch (x [T, H, D] may be a view of the
    fused qkv output); returns x."""
    from sparseserve.kernels.fused_layer_ops import rotary_
    return rotary_(x, *cos_sin)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, tp)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> torch.Tensor:
        # h is the residual stream [T, hidden]
        h = self.self_attn(self.input_layernorm(h), cos_sin, ctx, residual=h)
        return self.mlp(self.post_attention_layernorm(h), residual=h)

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None,
                      cos_sin: tuple[torch.Tensor, torch.Tensor],
                      ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused path (vLLM's layout): the residual stream is residual + x, carried apart
        so each residual add runs inside the next norm's kernel. x [T, hidden] is the last
        layer's MLP output (residual None: x is the stream itself) -> (this layer's MLP
        output, the stream before it). Same roundings as `forward`: the stream after the
        layer is residual' + x', rounded once. Split around attention as
        `attention_inputs` -> ctx.attention -> `attention_outputs` (the attention-free
        pieces are what worker/piecewise_graphs.py captures)."""
        qkv, residual = self.attention_inputs(x, residual, cos_sin)
        q, k, v = self.self_attn.split_qkv(qkv)
        a = ctx.attention(self.self_attn.layer, q, k, v).reshape(x.shape[0], -1)
        return self.attention_outputs(a, residual)

    def attention_inputs(self, x: torch.Tensor, residual: torch.Tensor | None,
                         cos_sin: tuple[torch.Tensor, torch.Tensor],
                         res_out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused path up to attention: (x, residual) as in forward_fused -> (qkv [T, Hq +
        2 Hkv, D] with RoPE applied, the stream residual + x [T, hidden], written into
        ``res_out`` when given: static buffers, residual itself included)."""
        h, residual = self.input_layernorm.add_forward(x, residual, res_out=res_out)
        return self.self_attn.fused_qkv(h, cos_sin), residual

    def attention_outputs(self, a: torch.Tensor, residual: torch.Tensor,
                          out: torch.Tensor | None = None, res_out: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused path after attention: a [T, Hq * D], the stream [T, hidden] -> (this
        layer's MLP output, the stream before it), written into ``out`` / ``res_out`` when
        given (``res_out`` may be ``residual``)."""
        a = self.self_attn.project_out(a)
        h, residual = self.post_attention_layernorm.add_forward(a, residual, res_out=res_out)
        return self.mlp(h, fused=True, out=out), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        rows = cfg.vocab_size if tp is None else vocab_shard(cfg.vocab_size, tp)[2]
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        # the fused decoder-layer kernels (kernels/fused_layer_ops.py): None = on CUDA tensors
        # without tp; True forces them (on CPU tensors under Triton's interpreter: tests)
        self.fused_ops: bool | None = None
        self.model = LlamaModel(cfg, tp)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, self.model.embed_tokens.num_embeddings,
                                     bias=False)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.model.embed_tokens(input_ids)  # [T, hidden]
        # vocabulary-parallel: look up the ids of this rank's rows, zeros elsewhere, sum
        start, _, per = vocab_shard(self.config.vocab_size, self.tp)
        local = input_ids - start
        outside = (local < 0) | (local >= per)
        h = self.model.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                   start: int, end: int) -> torch.Tensor:
        """Run layers [start, end) over the residual stream h [T, hidden] -> the stream."""
        cos_sin = self.rope.cos_sin(positions)  # every layer rotates with the same factors
        if not self.use_fused_ops(h):
            for layer in self.model.layers[start:end]:
                h = layer(h, cos_sin, ctx)
            return h
        residual = None  # the stream is residual + h, summed inside the next norm's kernel
        for layer in self.model.layers[start:end]:
            h, residual = layer.forward_fused(h, residual, cos_sin, ctx)
        # the full stream, as callers (layer-segmented prefill) keep it: one add per range
        return h if residual is None else residual + h

    def use_fused_ops(self, h: torch.Tensor) -> bool:
        """Whether run_layers takes the fused-kernel path for h: `fused_ops`, by default on
        CUDA tensors; never with tp (its all-reduces sit between the GEMM and the add)."""
        on = h.is_cuda if self.fused_ops is None else self.fused_ops
        return (on and self.tp is None and h.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and self.model.norm.weight.dtype == h.dtype)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] (residual stream after the last layer) -> fp32 logits [N, vocab].

        With tp: rank 0 gets the full logits [N, vocab] (gathered); the other ranks get
        their vocabulary slice [N, ceil(vocab / tp)], which is not for sampling."""
        h = self.model.norm(h)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(h, weight).float()
        if self.tp is None:
            return logits
        return self.tp.gather_logits(logits, self.config.vocab_size)

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights forward passes to `linear` (the fused q/k/v and gate/up buffers where
        their views still alias them, else the separate ones; o/down; the logits weight)."""
        out = []
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            out += [a.qkv_weight] if fused_ok(a.qkv_weight, qkv) else [p.weight for p in qkv]
            # gate and up apart: with packed weights the MLP runs them as two GEMMs with
            # fused post-ops (cpu_linear.silu_mul)
            out += [m.gate_proj.weight, m.up_proj.weight, a.o_proj.weight, m.down_proj.weight]
        out.append(self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)
        return out

    def pack_cpu_linears(self) -> int:
        """Give every linear weight oneDNN's packed copy (model/cpu_linear.py; CPU, fp32):
        call once the weights are loaded. Returns how many were packed (0: not applicable)."""
        return sum(pack(w) for w in self.linear_weights())

    @property
    def weight_shard(self):
        """None (load whole tensors), or with tp a function (name, full shape) ->
        (dim, start, end) | None that the loaders use to read only this rank's slice."""
        if self.tp is None:
            return None
        cfg, tp = self.config, self.tp
        return lambda name, shape: shard_spec(name, tuple(shape), cfg, tp)

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the parameters; every parameter must be set once."""
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in weights:
            if name not in params:
                if name == "lm_head.weight" and self.lm_head is None:
                    continue  # tied checkpoints sometimes store the head anyway
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                                 "is the checkpoint of a supported Llama-family architecture?")
            param = params[name]
            if self.tp is not None and name in VOCAB_PARALLEL and tensor.shape[0] < param.shape[0]:
                # the last rank's vocabulary rows past vocab_size are zero padding
                with torch.no_grad():
                    param[tensor.shape[0]:].zero_()
                param = param[:tensor.shape[0]]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the config expects {tuple(param.shape)}.")
            with torch.no_grad():
                param.copy_(tensor)
            missing.discard(name)
        if missing:
            shown = ", ".join(sorted(missing)[:8])
            raise ValueError(f"Checkpoint is missing {len(missing)} tensors the config needs "
                             f"(e.g. {shown}); the model was not loaded.")

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights for benchmarks (`load_format="dummy"`): small uniform values and
        unit norms so activations stay finite in bf16 through dozens of layers.

        With tp every rank draws each full tensor (one at a time) from the same stream and
        keeps its slice, so the sharded model equals the single-process one."""
        gens: dict[torch.device, torch.Generator] = {}
        shard = self.weight_shard
        full_shapes = None
        if shard is not None:
            from sparseserve.model.loader.hf import expected_weight_shapes
            full_shapes = expected_weight_shapes(self.config)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if p.device not in gens:
                gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            if shard is None:
                p.uniform_(-2e-2, 2e-2, generator=gens[p.device])
                continue
            full = torch.empty(full_shapes[name], dtype=p.dtype, device=p.device)
            full.uniform_(-2e-2, 2e-2, generator=gens[p.device])
            part = take_shard(full, shard(name, full.shape))
            del full
            p.zero_()  # vocabulary padding rows stay zero
            p[tuple(slice(0, n) for n in part.shape)].copy_(part)
