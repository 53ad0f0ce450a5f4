"""Conversion between HF transformers `Qwen3ForCausalLM` weights/config and ours (in memory).

LLaMA's conversion (model/llama/hf.py) plus the per-head q and k norms. A config with attention biases
(`attention_bias`, which also puts one on the output projection) or sliding-window layers is refused: ours
has neither.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from llamapipe.model.llama import LlamaConfig, hf as llama_hf
from llamapipe.model.qwen3.config import Qwen3Config

HF_ARCHITECTURE, HF_MODEL_TYPE = "Qwen3ForCausalLM", "qwen3"
_LAYER_NAMES = {**llama_hf.LAYER_NAMES, **{f"attention.{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in "qk"}}


def config_from_hf(hf_config: Union[Any, dict], make_vocab_size_divisible_by: int = 128) -> Qwen3Config:
    """Qwen3Config from a transformers Qwen3Config or a config.json dict."""
    hf = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    if hf.get("attention_bias"):
        raise ValueError("HF Qwen3 config has attention_bias true; only Qwen3 without attention biases is supported")
    if hf.get("use_sliding_window") or any(kind != "full_attention" for kind in hf.get("layer_types") or []):
        raise ValueError("HF Qwen3 config has sliding-window layers; only full causal attention is supported")
    return Qwen3Config(**llama_hf.hf_config_fields(hf, make_vocab_size_divisible_by))


def config_to_hf(config: LlamaConfig, token_ids: Optional[dict[str, Optional[int]]] = None) -> dict[str, Any]:
    """config.json contents for transformers' Qwen3ForCausalLM (full attention in every layer, no biases)."""
    return {**llama_hf.hf_config_dict(config, HF_ARCHITECTURE, HF_MODEL_TYPE, token_ids),
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": config.num_layers}


from_hf, to_hf = llama_hf.converters(config_from_hf, config_to_hf, _LAYER_NAMES)
