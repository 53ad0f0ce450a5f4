"""The shared building blocks of the LLaMA-shaped families (arXiv 2302.13971): RMSNorm, GQA attention with its
causal core, SwiGLU MLP, and the decoder layer that takes its parts from a family's `ModelSpec` (model/spec.py);
rotary embedding is model/rotary.py.

Activations are sequence-first, (s, b, h) as in Megatron-LM, or (s/tp, b, h) with sequence parallelism.
Linear layers are the tensor-parallel ones from core/tensor_parallel; q/k/v (and gate/up) stay separate
parameters but share one call so they pay one input gather. RoPE uses HF's rotate_half convention, so HF
checkpoints load without permuting q/k; with Megatron's --rotary-percent < 1 it rotates only the first
rotary_dim dims of each head (as Megatron and HF's partial_rotary_factor do), and with --use-rope-scaling its
frequencies are Llama 3.1's scaled ones. The head dim is Megatron's
kv_channels, which may differ from hidden/heads. Attention is torch's scaled_dot_product_attention
(causal), restricted to its FlashAttention kernel on CUDA under --use-flash-attn. Under context parallelism
(a CP group of more than one rank) each rank holds s/cp tokens in the load-balanced layout and the attention
core is `context_parallel_attention` (ring or all-gather, core/context_parallel); RoPE then takes the local
tokens' global positions. With packed documents (Megatron's --reset-attention-mask) every layer also gets the
document ids of the whole sequence, (b, s), and the core attends within documents (core/document_attention.py).

RMSNorm and RoPE have hand-written backwards (measured faster in eager mode on CPU: RMSNorm forward +
backward 1.3 ms against F.rms_norm's 1.9 ms at (256, 4, 256) fp32, 1 thread). Under torch.compile
(`--compile`, llamapipe/model/compile.py) they use plain ops instead, which inductor fuses together with
their neighbours and differentiates itself.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from llamapipe.core.context_parallel import context_parallel_attention
from llamapipe.core.document_attention import document_attention
from llamapipe.core.pipeline_parallel import seq_split
from llamapipe.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, add_bias, parallel_linear,
                                         set_tensor_model_parallel_attributes, tp_size_rank)
from llamapipe.model.piece_attention import PieceKVCache, cached_piece_attention
from llamapipe.model.recompute import discard_and_recompute, recompute_modules
from llamapipe.model.rotary import Rope, apply_rotary

if TYPE_CHECKING:
    from llamapipe.model.llama.config import LlamaConfig
    from llamapipe.model.spec import ModelSpec

try:  # NVIDIA apex, when installed, provides a fused CUDA RMSNorm
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine
except ImportError:
    fused_rms_norm_affine = None



class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the parameter dtype (apex's fused kernel on CUDA)."""

    def __init__(self, hidden_size: int, eps: float, *, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))
        set_tensor_model_parallel_attributes(self.weight, -1, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., h) -> (..., h)
        if not torch.compiler.is_compiling():  # compiled: inductor fuses F.rms_norm and derives its backward
            if fused_rms_norm_affine is not None and x.is_cuda:
                return fused_rms_norm_affine(x, self.weight, self.weight.shape, self.eps)
            if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
                return _RMSNormFunction.apply(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """fp32 weight * x * rstd with a hand-written backward: a third of autograd's kernels, saves x and rstd only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x * rstd
        grad_weight = (grad * normed).sum(dim=tuple(range(grad.dim() - 1)))
        grad_normed = grad * weight
        # d/dx (x * rstd) applied to grad_normed: rstd * (grad_normed - normed * mean(grad_normed * normed))
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        return grad_normed.sub_(normed.mul_(dot)).mul_(rstd), grad_weight, None


class Attention(nn.Module):
    """Grouped-query self-attention: q/k/v projections (with biases when the spec says `qkv_bias`, Qwen2),
    the spec's norm over each head of q and k when it says `qk_norm` (Qwen3), RoPE, the spec's
    `core_attention` and the output projection. Heads and query groups split over TP ranks, the sequence over
    the CP ranks of `cp_group` (None: one rank).

    A q/k norm's weight (head_dim,) is replicated over TP and acts on this rank's heads only, so each rank's
    gradient is the part of its heads: it is marked `per_head` and summed over TP at the step's end, as the
    sequence-parallel norms' are (core/tensor_parallel/layers.py `TP_PARTIAL_GRADS`), with or without sequence
    parallelism; its input is never a sequence shard, so it is not a sequence-parallel parameter."""

    def __init__(self, config: LlamaConfig, spec: ModelSpec, tp_group: Optional[Any], *, sequence_parallel: bool,
                 params_dtype: torch.dtype, recompute_core: bool, cp_group: Optional[Any] = None,
                 cp_comm_type: str = "p2p") -> None:
        super().__init__()
        tp_size, _ = tp_size_rank(tp_group)
        h, d, bias = config.hidden_size, config.head_dim, spec.qkv_bias
        self.heads = config.num_attention_heads // tp_size
        self.groups = config.num_query_groups // tp_size
        self.head_dim, self.tp_group, self.recompute_core = d, tp_group, recompute_core
        kw = dict(sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        self.q_proj = ColumnParallelLinear(h, config.num_attention_heads * d, tp_group, bias=bias, **kw)
        self.k_proj = ColumnParallelLinear(h, config.num_query_groups * d, tp_group, bias=bias, **kw)
        self.v_proj = ColumnParallelLinear(h, config.num_query_groups * d, tp_group, bias=bias, **kw)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, h, tp_group, **kw)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = spec.norm(d, config.norm_epsilon, params_dtype=params_dtype)
            self.k_norm = spec.norm(d, config.norm_epsilon, params_dtype=params_dtype)
            for norm in (self.q_norm, self.k_norm):
                set_tensor_model_parallel_attributes(norm.weight, -1, per_head=True)
        self.core = spec.core_attention(config, cp_group=cp_group, cp_comm_type=cp_comm_type,
                                        grouped=self.groups != self.heads)
        self.kv_cache = PieceKVCache()      # Seq1F1B: the earlier pieces' keys and values (piece_attention.py)
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type     # a Seq1F1B piece's attention under CP

    def forward(self, x: torch.Tensor, rope: Rope, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x: (s, b, h) or (s/tp, b, h) -> same; document_ids: (b, s) of the whole sequence, or None
        projections = (self.q_proj, self.k_proj, self.v_proj)
        outputs = parallel_linear(x, [p.weight for p in projections], self.tp_group, self.q_proj.input_mode)
        q, k, v = (add_bias(y, p.bias) for y, p in zip(outputs, projections))  # (s, b, heads*d) ...
        s, b = q.shape[:2]
        q = q.view(s, b, self.heads, self.head_dim)
        k = k.view(s, b, self.groups, self.head_dim)
        v = v.view(s, b, self.groups, self.head_dim)
        if self.recompute_core:  # selective recompute (arXiv 2205.05198): keep only q, k, v (before their norms)
            context = checkpoint(self._core, q, k, v, rope[0], rope[1], document_ids, use_reentrant=False)
        else:
            context = self._core(q, k, v, *rope, document_ids)
        return self.o_proj(context)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        # q: (s, b, heads, d), k/v: (s, b, groups, d) -> (s, b, heads*d)
        s, b = q.shape[:2]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, (cos, sin)).permute(1, 2, 0, 3)  # (b, heads, s, d)
        k = apply_rotary(k, (cos, sin)).permute(1, 2, 0, 3)  # (b, groups, s, d)
        piece = seq_split.current()
        if piece is None:
            out = self.core(q, k, v.permute(1, 2, 0, 3), document_ids)   # (b, heads, s, d)
        else:       # a Seq1F1B piece: also the keys of the sequence's earlier pieces
            out = cached_piece_attention(self.kv_cache, piece, q, k, v.permute(1, 2, 0, 3), self.cp_group,
                                         self.groups != self.heads, document_ids, self.cp_comm_type)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)


class CausalAttention(nn.Module):
    """The attention core under the causal mask: SDPA on one rank (its FlashAttention kernel on CUDA under
    --use-flash-attn), or over the whole sequence of the CP group (`context_parallel_attention`, ring or
    all-gather) when this rank holds s/cp tokens of it. Given document ids, the mask is causal within each
    document (block-causal): `document_attention` on one rank, the same blocks restricted under CP."""

    def __init__(self, config: LlamaConfig, *, cp_group: Optional[Any], cp_comm_type: str, grouped: bool) -> None:
        super().__init__()
        self.cp_group, self.cp_comm_type, self.grouped = cp_group, cp_comm_type, grouped
        self.use_flash_attn = config.use_flash_attn

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        # q: (b, heads, s, d), k/v: (b, groups, s, d) -> (b, heads, s, d); document_ids: (b, s * cp) or None
        if self.cp_group is not None:   # s is this rank's s/cp tokens: attend over the whole sequence
            return context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type, document_ids=document_ids)
        if document_ids is not None:
            return document_attention(q, k, v, document_ids)
        # --use-flash-attn: fail loudly rather than let SDPA fall back to a slower kernel
        kernel = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if self.use_flash_attn and q.is_cuda else nullcontext()
        with kernel:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), ffn features split over TP."""

    def __init__(self, config: LlamaConfig, tp_group: Optional[Any], *, sequence_parallel: bool,
                 params_dtype: torch.dtype) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.recompute_act = "act" in recompute_modules(config)     # the fork's --recompute-lgd
        kw = dict(sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        self.tp_group = tp_group
        self.gate_proj = ColumnParallelLinear(h, f, tp_group, **kw)
        self.up_proj = ColumnParallelLinear(h, f, tp_group, **kw)
        self.down_proj = RowParallelLinear(f, h, tp_group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (s, b, h) or (s/tp, b, h) -> same
        gate, up = parallel_linear(x, [self.gate_proj.weight, self.up_proj.weight], self.tp_group,
                                   self.gate_proj.input_mode)  # (s, b, f/tp) each
        if not (self.recompute_act and torch.is_grad_enabled()):
            return self.down_proj(_swiglu(gate, up))
        act = checkpoint(_swiglu, gate, up, use_reentrant=False)   # keeps gate and up, not silu(gate)
        out = self.down_proj(act)
        discard_and_recompute(act, _swiglu, (gate, up), out)       # nor act, which down_proj saved
        return out


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class DecoderLayer(nn.Module):
    """Pre-norm transformer block of the spec's parts: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, spec: ModelSpec, tp_group: Optional[Any], *, sequence_parallel: bool,
                 params_dtype: torch.dtype, cp_group: Optional[Any] = None, cp_comm_type: str = "p2p") -> None:
        super().__init__()
        kw = dict(sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        self.input_norm = spec.norm(config.hidden_size, config.norm_epsilon, **kw)
        modules = recompute_modules(config)      # partial recompute (model/recompute.py)
        self.attention = spec.attention(config, spec, tp_group, recompute_core="core_attn" in modules,
                                        cp_group=cp_group, cp_comm_type=cp_comm_type, **kw)
        self.post_attention_norm = spec.norm(config.hidden_size, config.norm_epsilon, **kw)
        self.mlp = spec.mlp(config, tp_group, **kw)
        self.recompute_norms, self.recompute_mlp = "layernorm" in modules, "mlp" in modules

    def forward(self, x: torch.Tensor, rope: Rope, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x: (s, b, h) or (s/tp, b, h) -> same
        grad = torch.is_grad_enabled()
        normed = self.input_norm(x)
        attended = self.attention(normed, rope, document_ids)
        if self.recompute_norms:        # q/k/v saved the norm's output: refilled before the attention's backward
            discard_and_recompute(normed, self.input_norm, (x,), attended)
        x = x + attended
        normed = self.post_attention_norm(x)
        if grad and self.recompute_mlp:     # Megatron's mlp: the block's GEMMs run again in the backward
            fed = checkpoint(self.mlp, normed, use_reentrant=False)
        else:
            fed = self.mlp(normed)
        if self.recompute_norms:
            discard_and_recompute(normed, self.post_attention_norm, (x,), fed)
        return x + fed
