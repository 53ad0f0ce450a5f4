"""`convert-hf import` checks an HF directory's config.json against its weights before anything is written.

A config.json that disagrees with the weights used to give a checkpoint anyway (issue 40): `num_hidden_layers: 4`
over eight layers dropped layers 4-7, `vocab_size: 1000` over 512 rows zero-padded the embedding, a 256-wide
config over 128-wide weights wrote an inconsistent checkpoint, `num_attention_heads: 0` was written, and an
extra `model.layers.99.*` tensor was ignored. Here every size config.json gives must be a positive whole number,
and the weights must be exactly the tensors, of exactly the shapes, that the model config.json describes has:
the family's own model (built on the meta device, no memory) converted to HF names by the family's adapter
says which, so the check follows the adapters and knows no family itself. Each mismatch is one line naming the
file, the tensor and the config.json key.
"""
from __future__ import annotations

import json
import re
from typing import Any

import torch

from llamapipe.core.parallel_state import ParallelState
from llamapipe.model.families import ModelFamily
from llamapipe.model.llama.config import trainable_defect

_SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
          "max_position_embeddings")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")      # RoPE's buffer, stored by older HF LLaMA checkpoints
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def read_config(path: str) -> dict[str, Any]:
    """config.json as a dict; one line naming the file when it is not a JSON object (e.g. cut short)."""
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not the object of an HF config")
    return config


def check_sizes(hf_config: dict[str, Any], path: str) -> None:
    """Every size config.json gives (layers, widths, heads, vocabulary) is a positive whole number."""
    for key in _SIZES + _OPTIONAL_SIZES:
        value = hf_config.get(key)
        if value is None and key in _OPTIONAL_SIZES:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            said = "has no " + key if key not in hf_config else f"gives {key} {value!r}"
            raise ValueError(f"{path} {said}; it must be a positive whole number")


_HF_KEYS = {"rope_theta": "rope_theta", "norm_epsilon": "rms_norm_eps", "rope_scaling_factor": "rope_scaling factor",
            "rope_low_freq_factor": "rope_scaling low_freq_factor",
            "rope_high_freq_factor": "rope_scaling high_freq_factor",
            "rope_original_max_position_embeddings": "rope_scaling original_max_position_embeddings"}


def check_numbers(hf_config: dict[str, Any], path: str) -> None:
    """rms_norm_eps and rope_theta are numbers and the RoPE parameters an object, before they are converted
    (issue 51: "abc" was imported as the norm epsilon, and a rope_scaling string ended in an AttributeError)."""
    for key in ("rope_scaling", "rope_parameters"):
        if hf_config.get(key) is not None and not isinstance(hf_config[key], dict):
            raise ValueError(f"{path} gives {key} {hf_config[key]!r}; it must be an object such as "
                             '{"rope_type": "llama3", "factor": 8.0, ...} or null')
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    for where, key in ((hf_config, "rms_norm_eps"), (hf_config, "rope_theta"), (params, "rope_theta"),
                       *((params, k) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings"))):
        value = where.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ValueError(f"{path} gives {key} {value!r}; it must be a number")


def check_trainable(config: Any, path: str) -> None:
    """The model config.json describes is one training runs and can set (`trainable_defect`, the trainer's check)."""
    defect = trainable_defect(config)
    if defect is not None:
        field, value, must = defect
        raise ValueError(f"{path} gives {_HF_KEYS.get(field, field)} {value!r}; it must be {must}, or training "
                         "refuses the imported checkpoint")


def expected_shapes(family: ModelFamily, config: Any) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of the model `config` describes, from the family's model and adapter."""
    try:
        with torch.device("meta"):
            model = family.model_class(config, ParallelState())
    except (ValueError, AssertionError, RuntimeError, ZeroDivisionError) as err:
        raise ValueError(f"config.json describes no model that can be built ({str(err).splitlines()[0]})") from None
    logical = dict(model.named_parameters())
    hf_tensors, _ = family.to_hf(config, logical)
    return {name: tuple(t.shape) for name, t in hf_tensors.items()}


def check_weights(weights: dict[str, torch.Tensor], hf_config: dict[str, Any], expected: dict[str, tuple[int, ...]],
                  path: str, tied: bool) -> None:
    """The weights are exactly the expected tensors (lm_head may be left out when tied), of the expected shapes."""
    layers = sorted({int(m.group(1)) for name in weights if (m := _LAYER.match(name))})
    count = hf_config["num_hidden_layers"]
    if layers != list(range(count)):
        raise ValueError(f"{path} gives num_hidden_layers {count} but the weights hold layers {_spans(layers)}")
    unknown = sorted(name for name in weights if name not in expected and not _HARMLESS.search(name))
    if unknown:
        raise ValueError(f"the weights hold {unknown[0]}{_more(unknown)}, which {path} does not describe")
    missing = [name for name in expected if name not in weights and not (tied and name == "lm_head.weight")]
    if missing:
        raise ValueError(f"the weights lack {missing[0]}{_more(missing)}, which {path} calls for")
    for name, shape in expected.items():
        found = tuple(weights[name].shape) if name in weights else shape
        if found != shape:
            dim = next(i for i, (a, b) in enumerate(zip(found, shape)) if a != b) if len(found) == len(shape) else 0
            raise ValueError(f"{path} does not match the weights: {name} is {list(found)}, but "
                             f"{_source(hf_config, name, dim, shape[dim])} makes it {list(shape)}")


# (a part of a tensor's name, its dimension) -> the config.json key that sizes it; a dimension not listed is the
# hidden size. By the tensor's role, not by the value: 4 heads x head_dim 12 is 48 like an intermediate_size 48,
# and the key named must be the heads (issue 51).
_ROLES = {("q_proj", 0): "heads", ("o_proj", 1): "heads", ("k_proj", 0): "kv", ("v_proj", 0): "kv",
          ("gate_proj", 0): "intermediate_size", ("up_proj", 0): "intermediate_size",
          ("down_proj", 1): "intermediate_size", ("embed_tokens", 0): "vocab_size", ("lm_head", 0): "vocab_size"}


def _source(hf_config: dict[str, Any], name: str, dim: int, size: int) -> str:
    """The config.json key(s) that give dimension `dim` (of `size`) of tensor `name`."""
    heads, kv = hf_config["num_attention_heads"], hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    role = next((r for (part, d), r in _ROLES.items() if d == dim and f"{part}." in name + "."), "hidden_size")
    if role == "heads":
        return f"num_attention_heads {heads} x head_dim {head_dim}"
    if role == "kv":
        return f"num_key_value_heads {kv} x head_dim {head_dim}"
    return f"{role} {hf_config[role]}" if hf_config[role] == size else "config.json"


def _spans(values: list[int]) -> str:
    """[0, 1, 2, 3, 99] -> '0-3 and 99'."""
    spans, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            spans.append(f"{start}-{v}" if v > start else str(v))
            start = None
    return ", ".join(spans[:-1]) + (" and " if len(spans) > 1 else "") + spans[-1] if spans else "none"


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""
