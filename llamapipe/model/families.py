"""The model family registry: what the rest of the code knows of a model, looked up in one place.

Each family is a folder `model/<name>/` whose package exports its `FAMILY` record (`model/spec.ModelFamily`:
config class, chunk class with the spec of its parts, HF adapter and names, parameter count, FLOPs per token,
presets); the registry is one line per family. Training builds chunks, the log line counts FLOPs, the
start-up memory check counts parameters and convert-hf picks the adapter through it: by `--model` preset
(`family_of_preset`), by the config in hand (`family_of`, also for a checkpoint's recorded config,
`config_from_dict`) or by an HF config.json's `model_type` (`family_of_hf`). docs/model.md, "Model families",
says how to add one.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from llamapipe.model import llama, qwen2, qwen3
from llamapipe.model.llama.config import LlamaConfig
from llamapipe.model.spec import ModelFamily

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
)}
PRESETS: dict[str, dict] = {name: fields for f in FAMILIES.values() for name, fields in f.presets.items()}


def qkv_bias_family() -> ModelFamily:
    """Megatron's --add-qkv-bias: the family whose parts are LLaMA's with biases on the q, k and v projections."""
    wanted = dataclasses.replace(FAMILIES["llama"].spec, qkv_bias=True)
    found = [family for family in FAMILIES.values() if family.spec == wanted]
    assert len(found) == 1, f"{len(found)} families are LLaMA with q/k/v biases"
    return found[0]


def family_named(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not known; the families are {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(config: LlamaConfig) -> ModelFamily:
    """The family of a model config (its `family` field)."""
    return family_named(config.family)


def family_of_preset(preset: str) -> ModelFamily:
    for family in FAMILIES.values():
        if preset in family.presets:
            return family
    raise ValueError(f"--model {preset} is not a known preset; choose one of {', '.join(PRESETS)}")


def family_of_hf(hf_config: dict[str, Any]) -> ModelFamily:
    """The family of an HF config.json dict, by its model_type (a config without one is LLaMA's)."""
    model_type = hf_config.get("model_type", FAMILIES["llama"].hf_model_type)
    for family in FAMILIES.values():
        if family.hf_model_type == model_type:
            return family
    known = ", ".join(f.hf_model_type for f in FAMILIES.values())
    raise ValueError(f"HF model_type {model_type!r} is not supported; the supported ones are {known}")


def config_from_dict(fields: dict[str, Any]) -> LlamaConfig:
    """A config from its recorded fields (a checkpoint's model_config); a record without `family` is LLaMA's."""
    return family_named(fields.get("family", "llama")).config_class(**fields)


def model_parameters(config: LlamaConfig, tp: int = 1) -> int:
    """Parameters of the built model of `config`'s family (vocabulary padded for `tp`)."""
    return family_of(config).parameters(config, tp)


def flops_per_token(config: LlamaConfig, seq_length: int, tp: int = 1, full_recompute: bool = False) -> float:
    """Training FLOPs per token of `config`'s family (Megatron's accounting, model/llama/counts.py)."""
    return family_of(config).flops_per_token(config, seq_length, tp, full_recompute)
