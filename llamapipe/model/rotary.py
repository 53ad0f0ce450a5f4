"""Rotary position embedding (RoPE) for the LLaMA-shaped families: the cos/sin tables (Llama 3.1's scaled
frequencies under --use-rope-scaling), and the rotation itself in HF's rotate_half convention, so HF checkpoints
load without permuting q/k; with Megatron's --rotary-percent < 1 only the first rotary_dim dims of each head turn.

The rotation has a hand-written backward (it rotates the gradient back, saving only cos/sin); under
torch.compile it uses plain ops, which inductor fuses and differentiates itself.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from llamapipe.model.llama.config import RopeScaling

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: (s, b or 1, 1, rotary_dim)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position_embeddings, computed once in fp32, over the
    rotary_dim rotated dims of a head (the frequencies depend on rotary_dim, not the head dim: Megatron), with
    Llama 3.1's frequency scaling when `scaling` is given (`scaled_inv_freq`)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float,
                 scaling: Optional[RopeScaling] = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        if scaling is not None:
            inv_freq = scaled_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)  # (p, d/2)
        table = torch.cat([freqs, freqs], dim=-1)  # (p, d)
        self.register_buffer("cos", table.cos(), persistent=False)
        self.register_buffer("sin", table.sin(), persistent=False)

    def forward(self, seq_len: int, position_ids: Optional[torch.Tensor], dtype: torch.dtype) -> Rope:
        if position_ids is None:
            if seq_len > self.cos.shape[0]:
                raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings ({self.cos.shape[0]})")
            cos, sin = self.cos[:seq_len, None, None, :], self.sin[:seq_len, None, None, :]  # (s, 1, 1, d)
        else:
            ids = position_ids.t().contiguous()  # (s, b): the tables below then have the same strides whatever
            # layout position_ids came in (an expanded (b, s) or a contiguous one), as a compiled layer expects
            cos, sin = self.cos[ids].unsqueeze(2), self.sin[ids].unsqueeze(2)  # (s, b, 1, d)
        return cos.to(dtype), sin.to(dtype)


def scaled_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaled RoPE frequencies (Meta's apply_scaling; HF's rope_type "llama3", Megatron-LM's
    --use-rope-scaling), the same operations as HF's `_compute_llama3_parameters`: a wavelength longer than
    original / low_freq_factor is slowed by `factor` (positions beyond the original context interpolate), one
    shorter than original / high_freq_factor stays (local order is kept), and between them the frequency
    interpolates linearly in original / wavelength."""
    original = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > original / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * slowed / s.factor + smooth * slowed
    medium = ~(wavelen < original / s.high_freq_factor) * ~(wavelen > original / s.low_freq_factor)
    return torch.where(medium, smoothed, slowed)


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """HF LLaMA's rotate_half RoPE on (s, b, heads, d): x * cos + rotate_half(x) * sin on the first
    rotary_dim dims (the tables' width); the other dims pass unchanged."""
    if torch.compiler.is_compiling():  # plain ops: inductor fuses them, forward and backward
        return _rotate_plain(x, *rope)
    return _RotaryFunction.apply(x, *rope)


def _rotate_plain(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    x1, x2 = x[..., :rot // 2], x[..., rot // 2:rot]
    out = x[..., :rot] * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, x[..., rot:]), dim=-1) if rot < x.shape[-1] else out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x * cos + sign * rotate_half(x) * sin on halves, without rotate_half's neg and cat copies.

    The tables repeat their first half (cat([freqs, freqs])), so each half of x meets the same cos/sin half.
    sign -1 is the transposed rotation, which is the backward of sign +1."""
    rot = cos.shape[-1]
    half = rot // 2
    x1, x2, c, s = x[..., :half], x[..., half:rot], cos[..., :half], sin[..., :half]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out1, out2 = out[..., :half], out[..., half:rot]
    torch.mul(x1, c, out=out1).addcmul_(x2, s, value=-sign)
    torch.mul(x2, c, out=out2).addcmul_(x1, s, value=sign)
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return out


class _RotaryFunction(torch.autograd.Function):
    """RoPE as a rotation: the backward rotates the gradient back, so only cos/sin are saved, not x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None
