"""The model family registry: what the rest of the code knows of a model, looked up in one place.

A `ModelFamily` holds a family's config class (a `LlamaConfig` subclass whose `family` field names it),
its chunk class (the Megatron chunk protocol of model/llama.py), its HF adapter and HF names, its parameter
count and training FLOPs per token, and its presets. Training builds chunks, the log line counts FLOPs, the
start-up memory check counts parameters and convert-hf picks the adapter through it: by `--model` preset
(`family_of_preset`), by the config in hand (`family_of`, also for a checkpoint's recorded config,
`config_from_dict`) or by an HF config.json's `model_type` (`family_of_hf`). docs/model.md, "Model families",
says how to add one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from llamapipe.model import config as llama_config, counts, hf_checkpoint, qwen2, qwen2_hf
from llamapipe.model.config import LlamaConfig
from llamapipe.model.llama import LlamaModel


@dataclass(frozen=True)
class ModelFamily:
    name: str
    config_class: type                  # LlamaConfig or a subclass whose `family` default is `name`
    model_class: type                   # the chunk: LlamaModel or a subclass
    hf_architecture: str                # config.json "architectures" entry export writes
    hf_model_type: str                  # config.json "model_type" import reads and export writes
    config_from_hf: Callable[..., LlamaConfig]
    config_to_hf: Callable[..., dict]
    from_hf: Callable[..., tuple]       # (HF state dict, HF config, divisible_by) -> (config, logical state dict)
    to_hf: Callable[..., tuple]         # (config, logical state dict, token ids) -> (HF state dict, config.json)
    parameters: Callable[..., int]      # (config, tp) -> parameters of the built model
    flops_per_token: Callable[..., float]   # (config, seq_length, tp, full_recompute) -> training FLOPs
    presets: dict[str, dict]


FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (
    ModelFamily("llama", LlamaConfig, LlamaModel, hf_checkpoint.HF_ARCHITECTURE, hf_checkpoint.HF_MODEL_TYPE,
                hf_checkpoint.config_from_hf, hf_checkpoint.config_to_hf, hf_checkpoint.from_hf,
                hf_checkpoint.to_hf, counts.model_parameters, counts.flops_per_token, llama_config.PRESETS),
    ModelFamily("qwen2", qwen2.Qwen2Config, qwen2.Qwen2Model, qwen2_hf.HF_ARCHITECTURE, qwen2_hf.HF_MODEL_TYPE,
                qwen2_hf.config_from_hf, qwen2_hf.config_to_hf, qwen2_hf.from_hf, qwen2_hf.to_hf,
                qwen2.model_parameters, qwen2.flops_per_token, qwen2.PRESETS),
)}
PRESETS: dict[str, dict] = {name: fields for f in FAMILIES.values() for name, fields in f.presets.items()}
BIAS_FAMILY = "qwen2"   # Megatron's --add-qkv-bias: the dense family whose q/k/v projections have biases


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
    model_type = hf_config.get("model_type", hf_checkpoint.HF_MODEL_TYPE)
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
    """Training FLOPs per token of `config`'s family (Megatron's accounting, model/counts.py)."""
    return family_of(config).flops_per_token(config, seq_length, tp, full_recompute)
