"""LLaMA model configuration (every family's base config) and named presets (nanoGPT/gpt-fast `from_name`).

A preset fixes the architecture; explicit shape flags on the command line override single fields
(llamapipe.training.arguments.model_args builds the config from the flags). The Llama 3.1/3.2/3.3 presets
carry Llama 3.1's RoPE frequency scaling (`use_rope_scaling`; HF's rope_type "llama3", Megatron-LM's
--use-rope-scaling / --rope-scaling-factor) with the shapes of Meta's published checkpoints (their
config.json files; the parameter counts are tests/unit/test_model_llama3.py's).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Meta's apply_scaling; HF rope_type "llama3"): the frequencies whose
    wavelength exceeds original_max_position_embeddings / low_freq_factor are divided by `factor`, those below
    original / high_freq_factor stay, and the ones between are interpolated smoothly
    (`model/rotary.py` `scaled_inv_freq`)."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    num_layers: int = 8
    hidden_size: int = 128
    ffn_hidden_size: int = 352
    num_attention_heads: int = 4
    num_query_groups: int = 2          # GQA: key/value heads; == num_attention_heads for MHA
    vocab_size: int = 1024             # true vocabulary (tokenizer size); padded only inside the model
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    recompute_granularity: Optional[str] = None   # None, "full" or "selective"
    recompute_num_layers: Optional[int] = None    # full recompute: first N layers of each chunk (None: all)
    recompute_modules: tuple = ()                 # parts recomputed (model/recompute.py): core_attn, mlp, layernorm,
                                                  # act; () under selective: core_attn (Megatron's default)
    kv_channels: Optional[int] = None  # Megatron's head dim; None: hidden_size // num_attention_heads
    rotary_percent: float = 1.0        # RoPE rotates the first rotary_percent of each head's dims
    use_flash_attn: bool = False       # CUDA: SDPA restricted to its FlashAttention kernel
    family: str = "llama"              # the model family (model/families.py); a family's config subclass sets it
    use_rope_scaling: bool = False     # Llama 3.1's RoPE frequency scaling (HF rope_type "llama3"), `rope_scaling`
    rope_scaling_factor: float = 8.0   # its factor (Megatron's default; Llama 3.2 1B/3B use 32)
    rope_low_freq_factor: float = 1.0  # wavelengths beyond original / low_freq_factor are divided by the factor
    rope_high_freq_factor: float = 4.0   # wavelengths below original / high_freq_factor stay; between: interpolated
    rope_original_max_position_embeddings: int = 8192   # the context the unscaled model was trained on

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (Megatron: int(kv_channels * rotary_percent)); the rest pass."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def rope_scaling(self) -> Optional["RopeScaling"]:
        """The RoPE frequency scaling the positions part applies, or None (plain RoPE)."""
        if not self.use_rope_scaling:
            return None
        return RopeScaling(self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                           self.rope_original_max_position_embeddings)

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Megatron's vocabulary padding: round up to a multiple of divisible_by x tp."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        own = type(self).__dataclass_fields__["family"].default
        if self.family != own:
            raise ValueError(f"{type(self).__name__} is the {own} family's config, not {self.family}'s")

    @classmethod
    def from_name(cls, name: str) -> "LlamaConfig":
        if name not in PRESETS:
            raise ValueError(f"--model {name} is not a known preset; choose one of {', '.join(PRESETS)}")
        return cls(**PRESETS[name])


SCALING_FIELDS = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings")


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def trainable_defect(c: LlamaConfig) -> Optional[tuple[str, Any, str]]:
    """(field, its value, what it must be) for the first value of `c` that training cannot run, else None.
    The one check behind the trainer's (model_args.check_model) and convert-hf import's (hf_import_checks), so an
    import never writes a model that training then refuses (issue 51: rope_theta 0 or NaN, Llama 3 scaling with
    original_max_position_embeddings 0 were imported). Llama 3 scaling's band factors and original context are
    any the model can compute (HF's bounds); Megatron's --use-rope-scaling sets 1, 4 and 8192, and
    --use-checkpoint-args takes a checkpoint's own (issue 49)."""
    for field in ("rope_theta", "norm_epsilon") + (("rope_scaling_factor",) + SCALING_FIELDS
                                                   if c.use_rope_scaling else ()):
        if not _positive_number(getattr(c, field)):
            return field, getattr(c, field), "a finite positive number"
    if c.use_rope_scaling and not c.rope_high_freq_factor > c.rope_low_freq_factor:
        return ("rope_high_freq_factor", c.rope_high_freq_factor,
                f"larger than rope_low_freq_factor ({c.rope_low_freq_factor:g})")
    if c.use_rope_scaling and c.rope_original_max_position_embeddings != int(c.rope_original_max_position_embeddings):
        return ("rope_original_max_position_embeddings", c.rope_original_max_position_embeddings, "a whole number")
    return None


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072, num_query_groups=8,
               use_rope_scaling=True, rope_scaling_factor=8.0)   # Llama 3.1 onwards: 128K context, scaled RoPE

PRESETS: dict[str, dict] = {
    "tiny": dict(num_layers=8, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                 num_query_groups=2, vocab_size=1024, max_position_embeddings=256),
    "llama2-7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                      num_query_groups=32, vocab_size=32000, max_position_embeddings=4096),
    "llama2-13b": dict(num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                       num_query_groups=40, vocab_size=32000, max_position_embeddings=4096),
    "llama2-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                       num_query_groups=8, vocab_size=32000, max_position_embeddings=4096),
    "llama3-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                      num_query_groups=8, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0),
    "llama3-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                       num_query_groups=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "llama3.1-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32),
    "llama3.1-70b": dict(_LLAMA3, num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64),
    "llama3.1-405b": dict(_LLAMA3, num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                          num_attention_heads=128),
    "llama3.2-1b": dict(_LLAMA3, num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                        rope_scaling_factor=32.0, tie_word_embeddings=True),
    "llama3.2-3b": dict(_LLAMA3, num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
                        rope_scaling_factor=32.0, tie_word_embeddings=True),
    "llama3.3-70b": dict(_LLAMA3, num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64),
}
