"""Conversion between HF transformers `LlamaForCausalLM` weights/config and ours (in memory).

Our RoPE uses HF's rotate_half convention, so q/k weights need NO rotary permutation (the permutation
exists only between Meta's interleaved-pair checkpoints and HF). GQA needs nothing either: k/v
projections keep their (num_query_groups * head_dim, hidden) shape. The vocabulary is padded with zero
rows to `padded_vocab_size(1)`; `LlamaModel.load_logical_state_dict` adapts it to any TP layout.
Reading and writing files belongs to the checkpointing code. A family of the same shape reuses the
pieces: `hf_config_fields` / `hf_config_dict` for the shared config keys, and `converters` for its `from_hf` /
`to_hf` with its own layer name map (model/qwen2/hf.py).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from llamapipe.model.llama.config import LlamaConfig

LAYER_NAMES = {  # ours -> HF, inside layers.<i>
    "input_norm.weight": "input_layernorm.weight",
    "attention.q_proj.weight": "self_attn.q_proj.weight",
    "attention.k_proj.weight": "self_attn.k_proj.weight",
    "attention.v_proj.weight": "self_attn.v_proj.weight",
    "attention.o_proj.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
HF_ARCHITECTURE, HF_MODEL_TYPE = "LlamaForCausalLM", "llama"
_TOP_NAMES = {"embedding.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _name_map(num_layers: int, tied: bool, layer_names: dict[str, str]) -> dict[str, str]:
    names = {ours: hf for ours, hf in _TOP_NAMES.items() if not (tied and ours == "output.weight")}
    for i in range(num_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{hf}" for ours, hf in layer_names.items()})
    return names


_LLAMA3_KEYS = {"factor": ("rope_scaling_factor", float), "low_freq_factor": ("rope_low_freq_factor", float),
                "high_freq_factor": ("rope_high_freq_factor", float),
                "original_max_position_embeddings": ("rope_original_max_position_embeddings", int)}  # HF: ours


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE theta and Llama 3.1's scaling from an HF config: transformers >= 5's `rope_parameters` or a
    config.json's `rope_scaling` beside `rope_theta`; rope types other than the default and "llama3" are refused."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return dict(rope_theta=theta)
    if rope_type != "llama3":
        raise ValueError(f"HF rope type {rope_type!r} is not supported; only the default RoPE and Llama 3.1's "
                         "'llama3' scaling are")
    missing = [key for key in _LLAMA3_KEYS if key not in params]
    if missing:
        raise ValueError(f"HF rope type 'llama3' needs {', '.join(missing)} in its RoPE parameters")
    return dict(rope_theta=theta, use_rope_scaling=True,
                **{ours: kind(params[key]) for key, (ours, kind) in _LLAMA3_KEYS.items()})


def rope_scaling_dict(config: LlamaConfig) -> Optional[dict[str, Any]]:
    """config.json's `rope_scaling` (None: plain RoPE), the form Meta's Llama 3.1 checkpoints ship."""
    if not config.use_rope_scaling:
        return None
    return {"rope_type": "llama3", **{key: getattr(config, ours) for key, (ours, _) in _LLAMA3_KEYS.items()}}


def hf_config_fields(hf: dict[str, Any], make_vocab_size_divisible_by: int = 128) -> dict[str, Any]:
    """Our config's fields from the keys LLaMA-shaped HF configs share (config.json as a dict)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF hidden_act {hf['hidden_act']!r} is not supported; LLaMA uses silu")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return dict(kv_channels=None if head_dim * heads == hf["hidden_size"] else head_dim,
                num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
                num_query_groups=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"],
                max_position_embeddings=hf["max_position_embeddings"], **_rope_fields(hf),
                norm_epsilon=hf.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                init_method_std=hf.get("initializer_range", 0.02))


def config_from_hf(hf_config: Union[Any, dict], make_vocab_size_divisible_by: int = 128) -> LlamaConfig:
    """LlamaConfig from a transformers LlamaConfig or a config.json dict."""
    hf = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("HF checkpoints with attention or MLP biases are not LLaMA-shaped; ours have no biases")
    return LlamaConfig(**hf_config_fields(hf, make_vocab_size_divisible_by))


def hf_config_dict(config: LlamaConfig, architecture: str, model_type: str,
                   token_ids: Optional[dict[str, Optional[int]]] = None) -> dict[str, Any]:
    """The config.json keys LLaMA-shaped HF configs share, for `architecture` / `model_type`."""
    if config.rotary_dim != config.head_dim:
        raise ValueError(f"rotary_percent {config.rotary_percent}: HF {architecture} rotates every head dim")
    return {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
            "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups, "head_dim": config.head_dim,
            "vocab_size": config.vocab_size, "max_position_embeddings": config.max_position_embeddings,
            "rope_theta": config.rope_theta, "rope_scaling": rope_scaling_dict(config), "rms_norm_eps": config.norm_epsilon,
            "tie_word_embeddings": config.tie_word_embeddings,
            "initializer_range": config.init_method_std, "torch_dtype": "float32", **(token_ids or {})}


def config_to_hf(config: LlamaConfig, token_ids: Optional[dict[str, Optional[int]]] = None) -> dict[str, Any]:
    """config.json contents for transformers' LlamaForCausalLM; `token_ids` (bos/eos/pad_token_id from the
    tokenizer) tell `generate` where to stop. The vocabulary is the model's true one, unpadded."""
    return {**hf_config_dict(config, HF_ARCHITECTURE, HF_MODEL_TYPE, token_ids),
            "attention_bias": False, "mlp_bias": False}


def convert_from_hf(config: LlamaConfig, hf_state_dict: dict[str, torch.Tensor],
                    layer_names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Our full logical state dict from an HF one, with the family's layer name map (ours -> HF)."""
    rows = config.padded_vocab_size(1)
    state_dict = {}
    for ours, hf in _name_map(config.num_layers, config.tie_word_embeddings, layer_names).items():
        if hf not in hf_state_dict:
            raise ValueError(f"HF state dict lacks {hf}")
        tensor = hf_state_dict[hf]
        if ours in ("embedding.weight", "output.weight"):
            tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], tensor.shape[1])])
        state_dict[ours] = tensor
    return state_dict


def convert_to_hf(config: LlamaConfig, state_dict: dict[str, torch.Tensor],
                  layer_names: dict[str, str]) -> dict[str, torch.Tensor]:
    """An HF state dict from our full logical one: every vocabulary row of config.vocab_size (padding dropped)."""
    hf_state_dict = {}
    for ours, hf in _name_map(config.num_layers, config.tie_word_embeddings, layer_names).items():
        tensor = state_dict[ours]
        if ours in ("embedding.weight", "output.weight"):
            assert tensor.shape[0] >= config.vocab_size, f"{ours} has {tensor.shape[0]} rows < {config.vocab_size}"
            tensor = tensor[:config.vocab_size]
        hf_state_dict[hf] = tensor
    if config.tie_word_embeddings:
        hf_state_dict["lm_head.weight"] = hf_state_dict["model.embed_tokens.weight"]
    return hf_state_dict


def converters(config_from_hf: Callable[..., LlamaConfig], config_to_hf: Callable[..., dict],
               layer_names: dict[str, str]) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
    """A LLaMA-shaped family's (from_hf, to_hf), from its config conversions and its layer name map:

    from_hf(hf_state_dict, hf_config, make_vocab_size_divisible_by=128) -> (our config, our full logical state
    dict); to_hf(config, state_dict, token_ids=None) -> (HF state dict, config.json dict), every vocabulary row
    of config.vocab_size (the padding rows dropped)."""
    def from_hf(hf_state_dict: dict[str, torch.Tensor], hf_config: Union[Any, dict],
                make_vocab_size_divisible_by: int = 128) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
        config = config_from_hf(hf_config, make_vocab_size_divisible_by)
        return config, convert_from_hf(config, hf_state_dict, layer_names)

    def to_hf(config: LlamaConfig, state_dict: dict[str, torch.Tensor],
              token_ids: Optional[dict[str, Optional[int]]] = None) -> tuple[dict[str, torch.Tensor], dict]:
        return convert_to_hf(config, state_dict, layer_names), config_to_hf(config, token_ids)
    return from_hf, to_hf


from_hf, to_hf = converters(config_from_hf, config_to_hf, LAYER_NAMES)   # LlamaForCausalLM's
