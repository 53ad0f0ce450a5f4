"""--use-checkpoint-args: the model shape from the --load checkpoint's metadata (Megatron's load_args_from_checkpoint).

As in Megatron, shape flags the user did not give are filled from the checkpoint (layers, hidden, MLP and
head sizes, positions, sequence length, vocabulary), while the architecture switches are always taken
from it (the model family, query groups and --group-query-attention, RoPE base, percent and scaling, tied
embeddings). With no
checkpoint in --load yet, the command line stands (Megatron prints the same and goes on); a --load that holds
only unusable checkpoints, or whose model_config lacks a field or holds a string or NaN, is one line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Optional

from llamapipe.core.config import ArgumentError
from llamapipe.model.families import family_named, qkv_bias_family
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.llama.config import SCALING_FIELDS
from llamapipe.training.checkpointing.io import METADATA, iter_dir
from llamapipe.training.checkpointing.selection import scan, unusable

_FILLED = {"num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
           "num_attention_heads": "num_attention_heads", "kv_channels": "kv_channels",
           "max_position_embeddings": "max_position_embeddings", "vocab_size": "vocab_size",
           "norm_epsilon": "norm_epsilon", "make_vocab_size_divisible_by": "make_vocab_size_divisible_by"}
_FORCED = {"num_query_groups": "num_query_groups", "rope_theta": "rotary_base", "rotary_percent": "rotary_percent"}


def with_checkpoint_args(args: argparse.Namespace, notices: list[str]) -> argparse.Namespace:
    """`args` with the checkpoint's model arguments (Megatron's fill/force rules), as if given on the command
    line; a copy, so the caller's `args` stays as parsed."""
    if getattr(args, "override_opt_param_scheduler", False) and getattr(args, "use_checkpoint_opt_param_scheduler",
                                                                         False):
        raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler cannot be "
                            "used together: the first takes the learning-rate schedule from the command line, "
                            "the second from the checkpoint")
    if not args.use_checkpoint_args:
        return args
    if args.load is None:
        raise ArgumentError("--use-checkpoint-args needs --load DIR, the checkpoint to take the model arguments from")
    meta, path = _saved_meta(args.load)
    if meta is None:
        notices.append(f"notice: --use-checkpoint-args: no checkpoint in --load {args.load} yet; "
                       "using the model arguments of the command line")
        return args
    model = _checked_model(meta["model_config"], path)
    values = {flag: model.get(field) for field, flag in _FILLED.items() if getattr(args, flag) is None}
    if args.vocab_size is None and (args.tokenizer_model is not None or args.tokenizer_type == "NullTokenizer"):
        # with a tokenizer the vocabulary follows from it and the run's own --vocab-size (NullTokenizer's is
        # one less than the model's), so the saved flag is taken, not the model's size
        values["vocab_size"] = ((meta.get("config") or {}).get("data") or {}).get("vocab_size")
    if args.seq_length is None:
        values["seq_length"] = ((meta.get("config") or {}).get("training") or {}).get("seq_length")
    values.update({flag: model.get(field) for field, flag in _FORCED.items()})
    scaling = {}
    if model.get("use_rope_scaling"):     # Llama 3.1's RoPE scaling: switched on with the checkpoint's factor...
        values["rope_scaling_factor"] = model.get("rope_scaling_factor")
        # ...and its bands and original context, which no flag sets (Megatron fixes 1, 4 and 8192)
        scaling = {field: model[field] for field in SCALING_FIELDS if model.get(field) is not None}
    values = {flag: value for flag, value in values.items() if value is not None}
    taken = ", ".join([f"--{flag.replace('_', '-')} {value}" for flag, value in values.items()]
                      + (["RoPE scaling's " + ", ".join(f"{field[5:]} {value:g}" for field, value in scaling.items())]
                         if scaling else []))
    notices.append(f"--use-checkpoint-args: {taken} from {path}")
    tie = bool(model.get("tie_word_embeddings"))
    return argparse.Namespace(**{**vars(args), **values, **scaling, "checkpoint_family": model.get("family", "llama"),
                                 "tie_embeddings_and_output_weights": tie,
                                 "use_rope_scaling": bool(model.get("use_rope_scaling")),
                                 "untie_embeddings_and_output_weights": not tie,
                                 "group_query_attention": model["num_query_groups"] != model["num_attention_heads"],
                                 "add_qkv_bias": (model.get("family") == qkv_bias_family().name
                                                  or getattr(args, "add_qkv_bias", False))})


_REAL_FIELDS = ("norm_epsilon", "rope_theta", "rotary_percent", "rope_scaling_factor", "rope_low_freq_factor",
                "rope_high_freq_factor")


def _checked_model(model: dict, path: str) -> dict:
    """`model` (a checkpoint's model_config) when every field taken from it is there and a finite number of the
    flag's kind; else one line naming the field and the value (issue 51: `{}` gave a KeyError, a string a
    TypeError in the checks after)."""
    where = f"--use-checkpoint-args: {os.path.join(path, METADATA)}"
    for field in ("num_attention_heads", "num_query_groups"):
        if field not in model:
            raise ArgumentError(f"{where} has no model_config {field}; give the model's flags without "
                                "--use-checkpoint-args")
    for field in (*_FILLED, *_FORCED, "rope_scaling_factor", *SCALING_FIELDS):
        value = model.get(field)
        real = field in _REAL_FIELDS
        if value is None or (isinstance(value, (float, int) if real else int) and not isinstance(value, bool)
                             and math.isfinite(value)):
            continue
        raise ArgumentError(f"{where} records model_config {field} {value!r}, not a finite "
                            f"{'number' if real else 'integer'}; give the model's flags without --use-checkpoint-args")
    return model


def _saved_meta(load_dir: str) -> tuple[Optional[dict], Optional[str]]:
    """(metadata, its checkpoint dir) of what --load resumes (megatron_resume.source): the newest complete
    checkpoint of ours, or a Megatron save's args as our fields; (None, None) when there is none yet."""
    from llamapipe.training.checkpointing.megatron_resume import megatron_meta, source
    kind, directory = source(load_dir) if os.path.isdir(load_dir) else ("ours", load_dir)
    if kind == "megatron":
        try:
            return megatron_meta(directory)
        except ValueError as exc:
            raise ArgumentError(f"--use-checkpoint-args: {exc}") from None
    found = _newest_complete(directory)
    if found is None:
        return None, None
    with open(os.path.join(found[1], METADATA)) as fh:
        return json.load(fh), found[1]


def _newest_complete(load_dir: str):
    """(iteration, path) of the newest complete checkpoint, None when `load_dir` holds none yet; when it holds
    only unusable ones (a Megatron-layout directory, say), the loader's one line now, not 'none yet' here and
    'none is usable' from the loader after it (issue 51)."""
    if not os.path.isdir(load_dir):
        return None
    found = scan(load_dir)
    complete = [iteration for iteration, defect in found if defect is None]
    if found and not complete:
        raise ArgumentError(unusable(load_dir, [f"{os.path.basename(iter_dir(load_dir, i))} ({defect})"
                                                for i, defect in found]))
    return (complete[0], iter_dir(load_dir, complete[0])) if complete else None


# Model fields a checkpoint fixes, with the flag that sets each (RoPE base and norm epsilon change the
# function without changing any shape, so they are checked too); the family is said by `_family_setting`.
_CHECKED = {"family": None, "num_layers": "--num-layers", "hidden_size": "--hidden-size",
            "ffn_hidden_size": "--ffn-hidden-size", "num_attention_heads": "--num-attention-heads",
            "num_query_groups": "--num-query-groups", "vocab_size": "--vocab-size (or --tokenizer-model)",
            "tie_word_embeddings": "--tie-embeddings-and-output-weights", "rope_theta": "--rotary-base",
            "norm_epsilon": "--norm-epsilon", "kv_channels": "--kv-channels", "rotary_percent": "--rotary-percent",
            "use_rope_scaling": "--use-rope-scaling", "rope_scaling_factor": "--rope-scaling-factor",
            **dict.fromkeys(SCALING_FIELDS, "")}      # no flag: --use-checkpoint-args takes them


def check_saved_model(saved: dict, current: LlamaConfig, path: str) -> None:
    """ValueError, one line, when the checkpoint's model (`saved`, its recorded fields) is not this run's: every
    field that differs, the flags that set them, and --use-checkpoint-args, which sets them all at once (an
    imported HF checkpoint differs from the defaults in most)."""
    differ = [field for field in _CHECKED if field in saved and saved[field] != getattr(current, field)]
    if not differ:
        return
    settings = ", ".join(_family_setting(saved[f]) if f == "family" else f"{_CHECKED[f]} {saved[f]}" for f in differ
                         if _CHECKED[f] != "")
    unflagged = [f for f in differ if _CHECKED[f] == ""]
    fix = (f"set {settings}, or give --use-checkpoint-args to take the model's shape from the checkpoint"
           if not unflagged else f"give --use-checkpoint-args, which takes {', '.join(unflagged)} (no flag sets "
           "them) and the rest of the model's shape from the checkpoint")
    raise ValueError(f"checkpoint {path} was saved with {', '.join(f'{f} {saved[f]}' for f in differ)} but this "
                     f"run has {', '.join(str(getattr(current, f)) for f in differ)}; {fix}")


def _family_setting(name: str) -> str:
    """How a run asks for model family `name`: one of its --model presets (or Megatron's Qwen2 flag)."""
    family = family_named(name)
    bias = " or --add-qkv-bias" if family is qkv_bias_family() else ""
    return f"--model with a {name} preset ({', '.join(family.presets)}){bias}"
