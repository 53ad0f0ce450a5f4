"""Convert between Megatron-LM checkpoints (torch_dist) and llamapipe checkpoints, in any parallel layout.

  llamapipe convert-megatron import --load MEGATRON_DIR --save DIR [--tensor-model-parallel-size T
      --pipeline-model-parallel-size P --num-layers-per-virtual-pipeline-stage V]
  llamapipe convert-megatron export --load DIR --save MEGATRON_DIR

Import reads a Megatron save directory (latest_checkpointed_iteration.txt + iter_XXXXXXX/, or one iter dir) in
torch_dist format, whatever TP/PP Megatron saved it with (the DCP tensors are global), or in the legacy
`--ckpt-format torch` (mp_rank_XX[_YYY]/model_optim_rng.pt, put back together by its args' tp x pp), takes the model shape,
RoPE base and vocabulary from its common.pt args, and writes our checkpoint at Megatron's iteration, model
weights only (train from it with --finetune or --no-load-optim). Export writes any checkpoint of ours as a
torch_dist iter directory that megatron-core's dist_checkpointing.load reads into GPTModel's sharded state
dict, with common.pt (args, iteration) and latest_checkpointed_iteration.txt. Key map and what is carried:
docs/megatron_checkpoints.md. Bad input ends with one plain error line and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llamapipe.core.config import ParallelConfig, TrainingConfig
from llamapipe.model.families import config_from_dict
from llamapipe.model.llama import LlamaConfig
from llamapipe.training.checkpointing import io as cio
from llamapipe.training.config import Config
from llamapipe.training.flag_parser import FlagParser
from llamapipe.tools import megatron_format as mf
from llamapipe.tools.convert_hf import _write_import, model_specs

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


def import_megatron(load: str, save_dir: str, tp: int = 1, pp: int = 1, vpp: int = 1, *,
                    overwrite: bool = False) -> str:
    config, full, common, path, _ = read_megatron(load)
    try:
        specs = model_specs(config, tp)
    except ValueError as exc:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not fit this model: {exc}") from None
    iteration = int(common.get("iteration", 0) or 0)
    consumed = int(getattr(common["args"], "consumed_train_samples", 0) or 0)
    full = mf.fit_rows(full, config.padded_vocab_size(1))
    return _write_import(save_dir, overwrite, lambda progress: cio.write_layout(
        save_dir, iteration, full, specs, dataclasses.asdict(config), tp=tp, pp=pp, vpp=vpp,
        config=run_config(config, common["args"], tp, pp, vpp), progress=progress, consumed_samples=consumed))


def megatron_args(config: LlamaConfig, seq_length: int, iteration: int, **more) -> argparse.Namespace:
    """The args Megatron-LM records in common.pt, for the model fields."""
    return argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        kv_channels=config.head_dim, padded_vocab_size=config.padded_vocab_size(1), vocab_size=config.vocab_size,
        seq_length=seq_length, max_position_embeddings=config.max_position_embeddings,
        rotary_base=config.rope_theta, rotary_percent=config.rotary_percent, norm_epsilon=config.norm_epsilon,
        normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings, position_embedding_type="rope",
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by, num_experts=None,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ckpt_format="torch_dist",
        iteration=iteration, **{"consumed_train_samples": 0, **more})


def export_megatron(load: str, save_dir: str, *, replace: bool = False) -> str:
    """Write our checkpoint in `load` (any layout) as a Megatron torch_dist save in `save_dir`; returns its iter dir.
    The iter dir is written as iter_X.tmp and renamed; `replace`: an iter_X already there is replaced."""
    if os.path.isfile(os.path.join(load, cio.METADATA)):
        path = load
    else:
        found = cio.latest_checkpoint(load)
        if found is None:
            raise ValueError(f"--load {load} holds no complete checkpoint")
        path = found[1]
    reader = cio.CheckpointReader(path)
    config = config_from_dict(reader.meta["model_config"])
    if config.family != "llama":
        raise ValueError(f"checkpoint {path} is a {config.family} model; only llama exports to Megatron")
    full = mf.fit_rows({key: reader.logical(key) for key in reader.keys("model")}, config.padded_vocab_size(1))
    tensors = mf.to_megatron(full, config.num_layers, config.num_attention_heads, config.num_query_groups,
                             config.tie_word_embeddings)
    iteration = int(reader.meta.get("iteration", 0))
    training = (reader.meta.get("config") or {}).get("training") or {}
    seq = training.get("seq_length", config.max_position_embeddings)
    out = os.path.join(save_dir, f"iter_{iteration:07d}")
    if os.path.exists(out) and not replace:
        raise ValueError(f"--save {save_dir} already holds {os.path.basename(out)}")
    final, out = out, out + ".tmp"
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    # each layer's linear modules' _extra_state (None in the local spec), as megatron-core packs a ShardedObject
    objects = {f"decoder.layers.{name}._extra_state/shard_{i}_{config.num_layers}": [None]
               for name in mf.EXTRA_STATE for i in range(config.num_layers)}
    dcp.save({**tensors, **objects}, storage_writer=dcp.FileSystemWriter(out), no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))
    args = megatron_args(config, seq, iteration, consumed_train_samples=int(reader.meta.get("consumed_samples", 0)),
                         global_batch_size=training.get("global_batch_size"), exported_from=path)
    torch.save({"args": args, "iteration": iteration, "checkpoint_version": 3.0}, os.path.join(out, "common.pt"))
    with open(os.path.join(out, "metadata.json"), "w") as fh:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, fh)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(out, final)
    with open(os.path.join(save_dir, TRACKER + ".tmp"), "w") as fh:
        fh.write(str(iteration))
    os.replace(os.path.join(save_dir, TRACKER + ".tmp"), os.path.join(save_dir, TRACKER))
    return final


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(prog="llamapipe convert-megatron", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Megatron save (torch_dist or legacy) -> llamapipe checkpoint",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    imp.add_argument("--load", required=True, help="Megatron save directory (or one iter_XXXXXXX dir), torch_dist or legacy torch")
    imp.add_argument("--save", required=True, help="checkpoint directory to write (Megatron's iteration, weights)")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size of the written layout")
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size of the written layout")
    imp.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=1, help="virtual stages (VPP)")
    imp.add_argument("--overwrite-save", action="store_true", help="delete the checkpoints already in --save first")
    exp = sub.add_parser("export", help="llamapipe checkpoint -> Megatron torch_dist save",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    exp.add_argument("--load", required=True, help="a save directory of ours or one iter_XXXXXXX directory")
    exp.add_argument("--save", required=True, help="Megatron save directory to write")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.command == "import":
            out = import_megatron(args.load, args.save, args.tensor_model_parallel_size,
                                  args.pipeline_model_parallel_size, args.num_virtual_stages_per_pipeline_rank,
                                  overwrite=args.overwrite_save)
            print(f"wrote {out}")
        else:
            print(f"wrote {export_megatron(args.load, args.save)}")
    except (ValueError, OSError, KeyError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"convert_megatron.py: error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
