"""Convert between HF transformers directories (LLaMA, Qwen2) and llamapipe checkpoints, in any parallel layout.

  llamapipe convert-hf import --hf-dir D --save DIR [--tensor-model-parallel-size T
      --pipeline-model-parallel-size P --num-layers-per-virtual-pipeline-stage V]
  llamapipe convert-hf export --load DIR --hf-dir D [--tokenizer-model PATH]

Import writes iteration 0, model weights only (train from it with --finetune, or --no-load-optim), holding the
--save lock as training does; a --save that holds checkpoints already is refused (--overwrite-save deletes them).
Export takes any checkpoint (any layout; DIR may be a save dir or one iter_XXXXXXX dir) and writes
model.safetensors + config.json that transformers' AutoModelForCausalLM.from_pretrained loads, every vocabulary
row the checkpoint records (gathered over its TP shards), and the run's tokenizer (recorded in the
checkpoint's metadata.json, or --tokenizer-model) in the form AutoTokenizer.from_pretrained loads.
The model family comes from config.json's model_type on import and from the checkpoint's recorded config on
export (model/families.py). Bad input ends with one plain error line and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable

import torch

from llamapipe.training.checkpointing import io as cio
from llamapipe.core.config import ParallelConfig, TrainingConfig
from llamapipe.training.flag_names import flag_message
from llamapipe.training.flag_parser import FlagParser
from llamapipe.training.config import Config
from llamapipe.safe_files import check_target, replace_atomically, replace_with
from llamapipe.training.checkpointing import save_lock
from llamapipe.training.checkpointing.integrity import write_safetensors
from llamapipe.training.checkpointing.save_history import check_history
from llamapipe.training.checkpointing.resharding import model_specs
from llamapipe.model.llama import LlamaConfig
from llamapipe.tools.hf_import_checks import (check_numbers, check_sizes, check_trainable, check_weights,
                                              expected_shapes, read_config)
from llamapipe.model.families import config_from_dict, family_of, family_of_hf
from llamapipe.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from llamapipe.data.tokenizers.hf_export import OUTPUT_FILES as TOKENIZER_FILES, special_token_ids, write_hf_tokenizer


def read_hf_dir(hf_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """HF config.json and weights (safetensors, weights-only pytorch_model.bin, or a sharded index)."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--hf-dir {hf_dir} has no config.json")
    hf_config = read_config(config_path)
    files = _weight_files(hf_dir)
    state_dict: dict[str, torch.Tensor] = {}
    for path in files:
        if path.endswith(".safetensors"):
            handle = cio.open_safetensors(path)
            state_dict.update({key: handle.get_tensor(key) for key in handle.keys()})
        else:
            state_dict.update(cio.safe_torch_load(path))
    return state_dict, hf_config


def _weight_files(hf_dir: str) -> list[str]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = os.path.join(hf_dir, index)
        if os.path.isfile(path):
            weight_map = read_config(path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{path} has no weight_map object")
            return [os.path.join(hf_dir, f) for f in sorted(set(weight_map.values()))]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(hf_dir, name)):
            return [os.path.join(hf_dir, name)]
    raise ValueError(f"--hf-dir {hf_dir} has no model.safetensors, pytorch_model.bin or *.index.json")


def import_hf(hf_dir: str, save_dir: str, tp: int, pp: int, layers_per_virtual_stage: int | None,
              make_vocab_size_divisible_by: int = 128, virtual_stages: int | None = None, *,
              overwrite: bool = False) -> str:
    hf_state_dict, hf_config = read_hf_dir(hf_dir)
    family, config_path = family_of_hf(hf_config), os.path.join(hf_dir, "config.json")
    check_sizes(hf_config, config_path)     # before anything divides by them or is written
    check_numbers(hf_config, config_path)
    config = family.config_from_hf(hf_config, make_vocab_size_divisible_by)
    check_trainable(config, config_path)
    check_weights(hf_state_dict, hf_config, expected_shapes(family, config), config_path, config.tie_word_embeddings)
    config, full = family.from_hf(hf_state_dict, hf_config, make_vocab_size_divisible_by)
    vpp = 1
    if layers_per_virtual_stage is not None:
        if config.num_layers % (pp * layers_per_virtual_stage):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} x "
                             f"--pipeline-model-parallel-size {pp} does not divide the model's "
                             f"{config.num_layers} layers")
        vpp = config.num_layers // (pp * layers_per_virtual_stage)
    if virtual_stages is not None:
        if layers_per_virtual_stage is not None:
            raise ValueError("give only one of --num-layers-per-virtual-pipeline-stage and "
                             "--num-virtual-stages-per-pipeline-rank")
        if virtual_stages < 1 or config.num_layers % (pp * virtual_stages):
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank {virtual_stages} x "
                             f"--pipeline-model-parallel-size {pp} does not divide the model's "
                             f"{config.num_layers} layers")
        vpp = virtual_stages
    try:
        specs = model_specs(config, tp)
    except ValueError as exc:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not fit this model: {exc}") from None
    parallel = ParallelConfig(world_size=tp * pp, tp_size=tp, pp_size=pp, vpp_size=vpp)
    # the context the model was trained for, which --use-checkpoint-args then takes as --seq-length
    training = TrainingConfig(seq_length=config.max_position_embeddings)
    run_config = dataclasses.asdict(Config(model=config, parallel=parallel, training=training))
    return _write_import(save_dir, overwrite, lambda progress: cio.write_layout(
        save_dir, 0, full, specs, dataclasses.asdict(config), tp=tp, pp=pp, vpp=vpp, config=run_config,
        progress=progress))


def _write_import(save_dir: str, overwrite: bool, write: Callable[[Callable], str]) -> str:
    """`write(progress)` into `save_dir` holding its lock, as training does, so a live run's directory is refused
    (issue 51); and only where no earlier history is (`save_history`: refused in one line, or deleted first with
    --overwrite-save), so the imported iteration 0 is the one a later --load takes. The directory is created only
    now, once the HF input has been read and checked."""
    from tqdm import tqdm
    lock = save_lock.acquire(save_dir)
    try:
        check_history(save_dir, None, overwrite, resume_hint=False)
        return write(lambda grid: tqdm(grid, desc="writing shards", unit="shard"))
    finally:
        lock.release()


def export_hf(load: str, hf_dir: str, tokenizer_model: str | None = None,
              tokenizer_type: str | None = None) -> tuple[str, list[str]]:
    """Write the checkpoint in `load` as an HF directory; returns (checkpoint dir, tokenizer files written)."""
    path, reader = cio.open_checkpoint(load)
    config = config_from_dict(reader.meta["model_config"])
    tokenizer = _run_tokenizer(reader.meta, path, tokenizer_model, tokenizer_type)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but checkpoint {path} records a vocabulary "
                         f"of {config.vocab_size}; give the --tokenizer-model it was trained with")
    full = {key: reader.logical(key) for key in reader.keys("model")}   # every TP shard's rows, padding dropped
    token_ids = special_token_ids(tokenizer) if tokenizer is not None else None
    hf_state_dict, hf_config = family_of(config).to_hf(config, full, token_ids)
    if config.tie_word_embeddings:  # HF re-ties lm_head on load; safetensors refuses shared storage
        hf_state_dict.pop("lm_head.weight")
    os.makedirs(hf_dir, exist_ok=True)
    for name in ("model.safetensors", "config.json") + TOKENIZER_FILES:   # refuse a planted link before writing
        check_target(os.path.join(hf_dir, name))
    # our writer, not safetensors': that one leaves mode 0600, the other files 0666 less the umask (issue 51)
    replace_with(os.path.join(hf_dir, "model.safetensors"), lambda tmp: write_safetensors(
        tmp, {k: v.contiguous() for k, v in hf_state_dict.items()}, {"format": "pt"}))
    with replace_atomically(os.path.join(hf_dir, "config.json"), "w") as fh:
        json.dump(hf_config, fh, indent=2)
    written = write_hf_tokenizer(tokenizer, hf_dir, config.max_position_embeddings,
                                 family_of(config).hf_tokenizer_config) if tokenizer else []
    return path, written


def _run_tokenizer(meta: dict, path: str, tokenizer_model: str | None, tokenizer_type: str | None):
    """The tokenizer named on the command line, else the one the checkpoint records (None: none recorded,
    e.g. an imported checkpoint)."""
    if tokenizer_model is None and tokenizer_type is None:
        recorded = meta.get("tokenizer")
        if recorded is None:
            return None
        tokenizer_model, tokenizer_type = recorded["model"], recorded["type"]
        if tokenizer_model is not None and not os.path.exists(tokenizer_model):
            raise ValueError(f"checkpoint {path} was trained with tokenizer {tokenizer_model}, which does not "
                             "exist any more; give --tokenizer-model")
    if tokenizer_type == "NullTokenizer":
        return None      # token ids without a text form: nothing to export
    return build_tokenizer(tokenizer_model, tokenizer_type)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(prog="llamapipe convert-hf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF directory -> llamapipe checkpoint",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    imp.add_argument("--hf-dir", required=True, help="HF model directory: config.json and model.safetensors, "
                     "pytorch_model.bin or a sharded *.index.json")
    imp.add_argument("--save", required=True, help="checkpoint directory to write (iteration 0, model weights only)")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size of the written layout")
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size of the written layout")
    imp.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                     help="layers per virtual stage (VPP), as training will use")
    imp.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                     help="virtual stages per pipeline rank (newer Megatron's spelling of VPP)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="vocabulary padding multiple (x TP), as training will use")
    imp.add_argument("--overwrite-save", action="store_true", help="delete the checkpoints already in --save "
                     "first; without it an import into a directory holding checkpoints is refused")
    exp = sub.add_parser("export", help="llamapipe checkpoint -> HF directory (weights, config and tokenizer)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    exp.add_argument("--load", required=True, help="a save directory (its newest complete checkpoint is taken) "
                     "or one iter_XXXXXXX directory, any layout")
    exp.add_argument("--hf-dir", required=True, help="output directory: model.safetensors, config.json and the "
                     "tokenizer files, loadable by AutoTokenizer / LlamaForCausalLM.from_pretrained")
    exp.add_argument("--tokenizer-model", default=None, help="tokenizer to export (a sentencepiece .model, or an "
                     "HF tokenizer.json or its directory); default: the one the checkpoint was trained with")
    exp.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                     help="kind of --tokenizer-model; default: guessed from the path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.command == "import":
            for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
                if getattr(args, flag) < 1:
                    raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
            out = import_hf(args.hf_dir, args.save, args.tensor_model_parallel_size,
                            args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage,
                            args.make_vocab_size_divisible_by, args.num_virtual_stages_per_pipeline_rank,
                            overwrite=args.overwrite_save)
            print(f"wrote {out}")
        else:
            out, tokenizer_files = export_hf(args.load, args.hf_dir, args.tokenizer_model, args.tokenizer_type)
            print(f"exported {out} to {args.hf_dir}" + (f" with tokenizer files {', '.join(tokenizer_files)}"
                  if tokenizer_files else " without a tokenizer (none recorded; give --tokenizer-model)"))
    except (ValueError, OSError, KeyError) as exc:
        message = flag_message(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"convert_hf.py: error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
