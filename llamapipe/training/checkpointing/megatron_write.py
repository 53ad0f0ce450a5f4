"""Any checkpoint of ours written as a Megatron-LM torch_dist save that megatron-core's dist_checkpointing.load
reads into GPTModel's sharded state dict: the DCP tensors under Megatron's names, common.pt (args, iteration),
metadata.json and the tracker file. Used by `--ckpt-format torch_dist` (megatron_save.py) and by
`llamapipe convert-megatron export` (docs/megatron_checkpoints.md)."""
from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from llamapipe.model.families import config_from_dict
from llamapipe.model.llama import LlamaConfig
from llamapipe.training.checkpointing import io as cio
from llamapipe.training.checkpointing import megatron_format as mf
from llamapipe.training.checkpointing.megatron_read import TRACKER

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
    path, reader = cio.open_checkpoint(load)
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
