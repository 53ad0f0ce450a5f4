"""What a resume from a checkpoint refuses, read from its metadata alone: no tensor is read.

`save_load.load_checkpoint` runs these checks before it copies anything; the dry run (`training/dry_run`) runs
them alone, for every role of a job, against a checkpoint directory or a saved metadata.json, so a layout
that cannot be resumed is found with the same message before the job is queued.
"""
from __future__ import annotations

import torch
from torch import nn

from llamapipe.model.config import LlamaConfig

# Model fields a checkpoint fixes, with the flag that sets each (RoPE base and norm epsilon change the
# function without changing any shape, so they are checked too).
MODEL_FIELDS = {"family": "--model (or --add-qkv-bias)", "num_layers": "--num-layers", "hidden_size": "--hidden-size",
                "ffn_hidden_size": "--ffn-hidden-size",
                "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
                "vocab_size": "--vocab-size (or --tokenizer-model)",
                "tie_word_embeddings": "--tie-embeddings-and-output-weights", "rope_theta": "--rotary-base",
                "norm_epsilon": "--norm-epsilon", "kv_channels": "--kv-channels", "rotary_percent": "--rotary-percent"}
OPTIM_HINT = "pass --no-load-optim to load the model weights only"


def check_model_config(saved: dict, current: LlamaConfig, path: str) -> None:
    for field, flag in MODEL_FIELDS.items():
        if field in saved and saved[field] != getattr(current, field):
            raise ValueError(f"checkpoint {path} was saved with {field} {saved[field]} but this run has "
                             f"{getattr(current, field)}; set {flag} {saved[field]}")


def trainable(tensors: dict[str, torch.Tensor]) -> dict[str, nn.Parameter]:
    """The trainable parameters among `tensors` (a tied one once): those with optimizer state."""
    out, seen = {}, set()
    for name, t in tensors.items():
        if isinstance(t, nn.Parameter) and t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def check_loadable(meta: dict, path: str, tensors: dict[str, torch.Tensor], model: LlamaConfig, *,
                   optimizer: bool) -> None:
    """Raise ValueError (one line) when the checkpoint at `path`, whose metadata.json is `meta`, cannot be loaded
    into this rank's `tensors` (`resharding.named_tensors`) of a `model`; `optimizer`: its state is loaded too."""
    check_model_config(meta["model_config"], model, path)
    for name in tensors:
        if f"model:{name}" not in meta["tensors"]:
            raise ValueError(f"checkpoint {path} has no tensor {name}, so it was saved from a different model")
    if not optimizer:
        return
    if not meta["has_optimizer"]:
        raise ValueError(f"checkpoint {path} has no optimizer state; {OPTIM_HINT}")
    saved = {key.split(":", 1)[1].rsplit("/", 1)[0] for key in meta["tensors"] if key.startswith("optim:")}
    for name in trainable(tensors):
        if name not in saved:
            raise ValueError(f"checkpoint {path} has no optimizer state for parameter {name}; {OPTIM_HINT}")
