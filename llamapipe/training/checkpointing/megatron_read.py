"""Megatron-LM save directories read without Megatron: the iteration directory a save names, its tensors (torch_dist's
DCP files, or the legacy mp_rank_* files put back together), the model shape from common.pt's args, and the
weights under our logical names. Used by `--load` of a Megatron save (megatron_resume.py) and by
`llamapipe convert-megatron import`; the format itself is megatron_format.py (docs/megatron_checkpoints.md)."""
from __future__ import annotations

import dataclasses
import os
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llamapipe.core.config import ParallelConfig, TrainingConfig
from llamapipe.model.llama import LlamaConfig
from llamapipe.training.checkpointing import megatron_format as mf
from llamapipe.training.config import Config

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(load: str) -> str:
    """The iter directory `load` names: itself if it holds .metadata, else the one its tracker file names."""
    if os.path.isfile(os.path.join(load, ".metadata")):
        return load
    tracker = os.path.join(load, TRACKER)
    if not os.path.isfile(tracker):
        raise ValueError(f"--load {load} is not a Megatron save directory (no {TRACKER}, no .metadata)")
    text = open(tracker).read().strip()
    if text == "release":
        path = os.path.join(load, "release")
    elif text.isdigit():
        path = os.path.join(load, f"iter_{int(text):07d}")
    else:
        raise ValueError(f"{tracker} holds {text[:40]!r}, not an iteration number")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        if os.path.isdir(path) and any(n.startswith("mp_rank_") for n in os.listdir(path)):
            return path
        raise ValueError(f"{tracker} names {path}, which holds no torch_dist (.metadata) or legacy (mp_rank_*) "
                         "checkpoint")
    return path


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory at its global shape, in one process; a missing or short file is refused."""
    reader = dcp.FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise ValueError(f"{path}/.metadata cannot be read ({type(exc).__name__}: {exc})") from None
    for name in sorted({item.relative_path for item in metadata.storage_data.values()}):
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"{path} lacks shard file {name} that its .metadata lists")
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:   # CheckpointException is a BaseException
        failures = getattr(exc, "failures", {})
        cause = next(iter(failures.values()), exc) if failures else exc
        raise ValueError(f"{path}: a shard file is damaged or short ({type(cause).__name__})") from None
    return state


def config_of(args, source: str) -> LlamaConfig:
    """Our model config from Megatron's args (common.pt)."""
    def get(name, default=None):
        return getattr(args, name, default)
    if get("num_experts"):
        raise ValueError(f"{source} is a mixture-of-experts model ({get('num_experts')} experts); llamapipe "
                         "reads LLaMA-shaped Megatron models only")
    if str(get("normalization", "RMSNorm")) != "RMSNorm" or get("add_bias_linear") or get("add_qkv_bias"):
        raise ValueError(f"{source} has normalization {get('normalization')}, add_bias_linear "
                         f"{get('add_bias_linear')}, add_qkv_bias {get('add_qkv_bias')}; llamapipe reads "
                         "RMSNorm models without biases")
    heads = get("num_attention_heads")
    groups = get("num_query_groups") if get("group_query_attention") else heads
    vocab = get("padded_vocab_size") or get("vocab_size")
    positions = get("max_position_embeddings") or get("seq_length")
    kv = get("kv_channels")
    return LlamaConfig(num_layers=get("num_layers"), hidden_size=get("hidden_size"),
                       ffn_hidden_size=get("ffn_hidden_size"), num_attention_heads=heads,
                       num_query_groups=groups or heads, vocab_size=vocab, max_position_embeddings=positions,
                       rope_theta=float(get("rotary_base", 10000.0)), norm_epsilon=get("norm_epsilon", 1e-5),
                       tie_word_embeddings=not get("untie_embeddings_and_output_weights", False),
                       make_vocab_size_divisible_by=get("make_vocab_size_divisible_by", 128),
                       kv_channels=None if kv is None or kv * heads == get("hidden_size") else kv,
                       rotary_percent=float(get("rotary_percent", 1.0)))


_LEGACY = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def read_legacy(path: str) -> tuple[dict, dict[str, torch.Tensor], LlamaConfig]:
    """(common state, global tensors, config) of a legacy `--ckpt-format torch` iter dir:
    mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt, each read as common.pt is (megatron_format.load_common)."""
    shards, common = {}, None
    for name in sorted(os.listdir(path)):
        match = _LEGACY.match(name)
        if not match:
            continue
        file = os.path.join(path, name, "model_optim_rng.pt")
        if not os.path.isfile(file):
            raise ValueError(f"{path}/{name} has no model_optim_rng.pt")
        state = mf.load_common(file)
        if not isinstance(state.get("model"), dict) or state.get("args") is None:
            raise ValueError(f"{file} has no model state dict or no args; it is not a Megatron checkpoint")
        if any(key.startswith("model0") for key in state):
            raise ValueError(f"{file} holds virtual pipeline chunks (model0, model1, ...), which are not read")
        shards[(int(match.group(1)), int(match.group(2) or 0))] = state["model"]
        common = common or state
    config = config_of(common["args"], path)
    args = common["args"]
    tp, pp = (getattr(args, f"{axis}_model_parallel_size", 1) or 1 for axis in ("tensor", "pipeline"))
    return common, mf.merge_legacy(shards, config.num_layers, tp, pp, path), config


def read_megatron(load: str) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict, str, dict[str, torch.Tensor]]:
    """(config, our full logical state dict, common state, iter dir, the save's `optimizer.*` tensors as stored)
    of a Megatron save (torch_dist or legacy; a legacy save's optimizer state is not read: {})."""
    path = iteration_dir(load)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        common, model, config = read_legacy(path)
        return config, _ours(model, config, path), common, path, {}
    common = _common(path)
    config = config_of(common["args"], path)
    tensors = read_tensors(path)
    model = {k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()
             if not k.startswith("optimizer")}
    optimizer = {k: v for k, v in tensors.items() if k.startswith("optimizer")}
    return config, _ours(model, config, path), common, path, optimizer


def _common(path: str) -> dict:
    """common.pt of a torch_dist iter dir, or the first rank's model_optim_rng.pt of a legacy one; it has args."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        file = os.path.join(path, "common.pt")
        if not os.path.isfile(file):
            raise ValueError(f"{path} has no common.pt (the run's args); checkpoints of releases that keep it "
                             "inside the DCP files are not read yet")
    else:
        ranks = sorted(n for n in os.listdir(path) if _LEGACY.match(n))
        file = os.path.join(path, ranks[0], "model_optim_rng.pt") if ranks else os.path.join(path, "common.pt")
    common = mf.load_common(file)
    if common.get("args") is None:
        raise ValueError(f"{file} records no args")
    return common


def megatron_args_of(path: str):
    """The args (argparse Namespace, classes as stand-ins) a Megatron iter dir records."""
    return _common(path)["args"]


def _ours(megatron: dict[str, torch.Tensor], config: LlamaConfig, source: str) -> dict[str, torch.Tensor]:
    """Our full logical tensors from Megatron's global ones named like its model's (weights or an optimizer field)."""
    full = mf.to_ours(megatron, config.num_layers, config.num_attention_heads, config.num_query_groups, source)
    if config.tie_word_embeddings:
        full.pop("output.weight", None)
    return full


def run_config(config: LlamaConfig, args, tp: int = 1, pp: int = 1, vpp: int = 1) -> dict:
    """The `config` a checkpoint of ours records, for a model imported from Megatron run `args`."""
    parallel = ParallelConfig(world_size=tp * pp, tp_size=tp, pp_size=pp, vpp_size=vpp)
    training = TrainingConfig(seq_length=getattr(args, "seq_length", config.max_position_embeddings))
    return dataclasses.asdict(Config(model=config, parallel=parallel, training=training))
