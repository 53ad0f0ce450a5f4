"""Conversion between HF transformers `Qwen2ForCausalLM` weights/config and ours (in memory).

LLaMA's conversion (model/llama/hf.py) plus the q/k/v biases. HF Qwen2 has no `attention_bias` key (its
biases are always there) and may use sliding-window attention, which ours does not: such a config is refused.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from llamapipe.model.llama import LlamaConfig, hf as llama_hf
from llamapipe.model.qwen2.config import Qwen2Config

HF_ARCHITECTURE, HF_MODEL_TYPE = "Qwen2ForCausalLM", "qwen2"
# transformers 5's AutoTokenizer builds its Qwen2Tokenizer for model_type qwen2 whatever tokenizer_config.json's
# tokenizer_class says (it keeps only the vocabulary and merges: Qwen's pre-tokenizer and NFC, no sentencepiece),
# unless the config has an auto_map; one naming no code makes it take tokenizer_class, as for LLaMA. (Loading
# with trust_remote_code=True then fails: there is no code to trust.)
HF_TOKENIZER_CONFIG = {"auto_map": {"AutoTokenizer": [None, None]}}
_LAYER_NAMES = {**llama_hf.LAYER_NAMES, **{f"attention.{p}_proj.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}}


def config_from_hf(hf_config: Union[Any, dict], make_vocab_size_divisible_by: int = 128) -> Qwen2Config:
    """Qwen2Config from a transformers Qwen2Config or a config.json dict."""
    hf = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    if hf.get("use_sliding_window"):
        raise ValueError("HF Qwen2 config has use_sliding_window true; only full causal attention is supported")
    return Qwen2Config(**llama_hf.hf_config_fields(hf, make_vocab_size_divisible_by))


def config_to_hf(config: LlamaConfig, token_ids: Optional[dict[str, Optional[int]]] = None) -> dict[str, Any]:
    """config.json contents for transformers' Qwen2ForCausalLM (full attention in every layer)."""
    return {**llama_hf.hf_config_dict(config, HF_ARCHITECTURE, HF_MODEL_TYPE, token_ids),
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": config.num_layers}


from_hf, to_hf = llama_hf.converters(config_from_hf, config_to_hf, _LAYER_NAMES)
