"""What a resume from a checkpoint refuses, read from its metadata alone: no tensor is read.

`save_load.load_checkpoint` runs these checks before it copies anything; the dry run (`training/dry_run`) runs
them alone, for every role of a job, against a checkpoint directory or a saved metadata.json, so a layout
that cannot be resumed is found with the same message before the job is queued.
"""
from __future__ import annotations

import torch
from torch import nn

from llamapipe.core.distributed.tied_embeddings import logical_name
from llamapipe.model.llama import LlamaConfig
from llamapipe.training.arguments.checkpoint_args import check_saved_model

OPTIM_HINT = "pass --no-load-optim to load the model weights only"


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
    check_saved_model(meta["model_config"], model, path)
    for name, target in tensors.items():
        key = logical_name(name, target)                     # a tied copy loads the embedding
        if f"model:{key}" not in meta["tensors"]:
            raise ValueError(f"checkpoint {path} has no tensor {key}, so it was saved from a different model")
    if not optimizer:
        return
    if not meta["has_optimizer"]:
        raise ValueError(f"checkpoint {path} has no optimizer state; {OPTIM_HINT}")
    saved = {key.split(":", 1)[1].rsplit("/", 1)[0] for key in meta["tensors"] if key.startswith("optim:")}
    for name, target in trainable(tensors).items():
        key = logical_name(name, target)
        if key not in saved:
            raise ValueError(f"checkpoint {path} has no optimizer state for parameter {key}; {OPTIM_HINT}")
