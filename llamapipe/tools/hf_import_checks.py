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
            raise ValueError(f"{path} does not match the weights: {name} is {list(found)}, but {_source(hf_config, shape[dim])} "
                             f"makes it {list(shape)}")


def _source(hf_config: dict[str, Any], size: int) -> str:
    """Which config.json keys give a tensor dimension of `size`."""
    heads, kv = hf_config["num_attention_heads"], hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    sources = {"vocab_size": hf_config["vocab_size"], "hidden_size": hf_config["hidden_size"],
               "intermediate_size": hf_config["intermediate_size"],
               f"num_attention_heads {heads} x head_dim {head_dim}": heads * head_dim,
               f"num_key_value_heads {kv} x head_dim {head_dim}": kv * head_dim}
    keys = [key if " x " in key else f"{key} {value}" for key, value in sources.items() if value == size]
    return " and ".join(keys[:1]) or "config.json"


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
