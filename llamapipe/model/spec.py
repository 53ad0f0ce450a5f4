"""A model family as data: the swappable parts of its decoder (`ModelSpec`) and its registry record
(`ModelFamily`).

Megatron-LM builds its GPT model from a `ModuleSpec` naming each submodule (the attention with its core and
q/k layernorms, the MLP, the norms), and torchtitan keeps each model family in `models/<name>/` behind a
`ModelSpec`; this is both ideas at this code's size. A `ModelSpec` names the parts the shared LLaMA-shaped
chunk (`model/llama/model.py`) and its decoder layers (`model/layers.py`) are built from, so a family that
differs from LLaMA only in parts is a spec, a config class and an HF adapter in its folder `model/<name>/`,
not new layers. A `ModelFamily` is what the rest of the code knows of a family; `model/families.py` holds one
per family. docs/model.md, "Model families", says how to add one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Callable

from torch import nn

from llamapipe.model.layers import MLP, Attention, CausalAttention, RMSNorm
from llamapipe.model.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from llamapipe.model.llama.config import LlamaConfig


@dataclass(frozen=True)
class ModelSpec:
    """The parts of a decoder chunk; the defaults are LLaMA's."""

    norm: type[nn.Module] = RMSNorm            # every norm: (size, eps, *, sequence_parallel, params_dtype)
    attention: type[nn.Module] = Attention     # the q/k/v/o projections around the core: (config, spec, tp_group, ...)
    qkv_bias: bool = False                     # biases on the q, k and v projections (Qwen2; --add-qkv-bias)
    qk_norm: bool = False                      # `norm` over each head of q and k before RoPE (Qwen3; Megatron's
                                               # q_layernorm / k_layernorm)
    core_attention: type[nn.Module] = CausalAttention   # the mask: causal over the sequence (and the CP group)
    mlp: type[nn.Module] = MLP                 # the feed-forward block: (config, tp_group, *, sequence_parallel, ...)
    positions: type[nn.Module] = RotaryEmbedding   # the tables every layer gets: (rotary_dim, max_positions,
                                                   # theta, *, scaling: the config's rope_scaling or None)


@dataclass(frozen=True)
class ModelFamily:
    """A family's record: its config class (a `LlamaConfig` subclass whose `family` field names it), its chunk
    class (`LlamaModel` or a subclass naming its parts in `spec`), its HF adapter and HF names, its parameter
    count and training FLOPs per token, and its presets."""

    name: str
    config_class: type                  # LlamaConfig or a subclass whose `family` default is `name`
    model_class: type                   # the chunk: LlamaModel or a subclass with its own `spec`
    hf_architecture: str                # config.json "architectures" entry export writes
    hf_model_type: str                  # config.json "model_type" import reads and export writes
    config_from_hf: Callable[..., LlamaConfig]
    config_to_hf: Callable[..., dict]
    from_hf: Callable[..., tuple]       # (HF state dict, HF config, divisible_by) -> (config, logical state dict)
    to_hf: Callable[..., tuple]         # (config, logical state dict, token ids) -> (HF state dict, config.json)
    parameters: Callable[..., int]      # (config, tp) -> parameters of the built model
    flops_per_token: Callable[..., float]   # (config, seq_length, tp, full_recompute) -> training FLOPs
    presets: dict[str, dict]
    hf_tokenizer_config: dict = field(default_factory=dict)   # added to an export's tokenizer_config.json

    @classmethod
    def of(cls, name: str, config_class: type, model_class: type, presets: dict[str, dict], *, hf: ModuleType,
           parameters: Callable[..., int], flops_per_token: Callable[..., float]) -> "ModelFamily":
        """The record of a family whose HF adapter module `hf` has HF_ARCHITECTURE, HF_MODEL_TYPE,
        config_from_hf, config_to_hf, from_hf and to_hf (and HF_TOKENIZER_CONFIG where transformers needs more in
        an export's tokenizer_config.json to load the run's tokenizer)."""
        return cls(name, config_class, model_class, hf.HF_ARCHITECTURE, hf.HF_MODEL_TYPE, hf.config_from_hf,
                   hf.config_to_hf, hf.from_hf, hf.to_hf, parameters, flops_per_token, presets,
                   dict(getattr(hf, "HF_TOKENIZER_CONFIG", {})))

    @property
    def spec(self) -> ModelSpec:
        """The parts its chunk is built from."""
        return self.model_class.spec
