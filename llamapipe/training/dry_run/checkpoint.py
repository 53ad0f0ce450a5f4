"""The dry run's checkpoints: the files a rank would write, and what a resume would read or refuse.

Written (`files_written`, the rules of `save_load.save_checkpoint`): the model and optimizer shard of each
(tp, pp) position, by the rank with dp x cp index 0; every rank's random states; rank 0's optimizer common
state. Sizes are exact without writing: a shard file's header comes from `integrity.safetensors_header` over
meta tensors of the shapes and dtypes written (the optimizer's per-parameter form, `Optimizer.state_dict`:
Adam's moments in fp32 shaped like the tensor-parallel shard, and an fp32 master for half-precision weights;
vocabulary-parallel shards gathered on pipeline rank 0); the small torch files are serialised in memory.
Metadata.json, written by rank 0 at commit, is left out.

Read (`ResumeSource`): the checkpoint `--load` would resume from (the newest complete one, its files' sizes
checked, not their checksums) or a saved metadata.json (`--dry-run-checkpoint-layout`). For each role,
`resume_checks.check_loadable` refuses what the real load refuses, with its message, and the role's reads are
counted from the tensor index: every shard file of a tensor split over tp (the loader reads the whole logical
tensor and keeps its own slice), one file of a replicated one.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from llamapipe.core.optimizer.grad_scaler import build_grad_scaler
from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.checkpointing import io as cio
from llamapipe.training.checkpointing.integrity import safetensors_header
from llamapipe.training.checkpointing.resharding import named_tensors, spec_of
from llamapipe.training.checkpointing.resume_checks import check_loadable, trainable
from llamapipe.training.checkpointing.save_load import rng_state
from llamapipe.training.checkpointing.selection import choose_checkpoint
from llamapipe.training.config import Config

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _torch_bytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer().nbytes


def _shard_bytes(tensors: dict[str, torch.Tensor], specs: dict, ps: ParallelState) -> int:
    _, header = safetensors_header(tensors, cio.shard_metadata(tensors, specs, ps.tp_rank, ps.pp_rank))
    return 8 + len(header) + sum(t.numel() * t.element_size() for t in tensors.values())


def _gathered_over_pp(tensors: dict[str, torch.Tensor], params: dict, ps: ParallelState) -> dict:
    """The vocabulary-parallel shards as the writer stores them: whole over pp on pp rank 0, absent elsewhere."""
    out = {}
    for key, t in tensors.items():
        if not hasattr(params[key.split("/")[0]], "vocab_shards"):
            out[key] = t
        elif ps.pp_rank == 0:
            out[key] = torch.empty((t.shape[0] * ps.pp_size, *t.shape[1:]), dtype=t.dtype, device="meta")
    return out


def files_written(chunks: list[torch.nn.Module], config: Config, ps: ParallelState) -> list[tuple[str, int]]:
    """(file name, bytes) of every file this rank writes into a checkpoint of its (unsharded over dp) chunks."""
    files = []
    if ps.dp_cp_rank == 0:
        params = named_tensors(chunks)
        specs = {name: spec_of(t) for name, t in params.items()}
        model = _gathered_over_pp({n: t.detach() for n, t in params.items()}, params, ps)
        files.append((cio.shard_name("model", ps.tp_rank, ps.pp_rank), _shard_bytes(model, specs, ps)))
        mixed = any(p.dtype != torch.float32 for p in trainable(params).values())
        fields = ("exp_avg", "exp_avg_sq", "master_param") if mixed else ("exp_avg", "exp_avg_sq")
        optim = {f"{name}/{field}": torch.empty(p.shape, dtype=torch.float32, device="meta")
                 for name, p in trainable(params).items() for field in fields
                 if field != "master_param" or p.dtype != torch.float32}
        optim = _gathered_over_pp(optim, params, ps)
        key_specs = {key: specs[key.split("/")[0]] for key in optim}
        files.append((cio.shard_name("optim", ps.tp_rank, ps.pp_rank), _shard_bytes(optim, key_specs, ps)))
    if ps.rank == 0:
        scaler = build_grad_scaler(config.optimizer)
        common = {"step": 0, "grad_scaler": scaler.state_dict() if scaler is not None else {}}
        files.append((cio.OPTIM_COMMON, _torch_bytes(common)))
    files.append((cio.rng_name(ps.rank), _torch_bytes(rng_state())))
    return files


@dataclass(frozen=True)
class ResumeReads:
    """What one rank reads to resume, in bytes."""
    files: int
    read: int           # the logical tensors its chunks and their optimizer state are cut from
    kept: int           # its own shards of them

    def text(self, size) -> str:
        """In words, with `size` writing bytes (report.size)."""
        return (f"reads {self.files} files, {size(self.read)}, keeps {size(self.kept)} "
                f"({size(self.read - self.kept)} resharded away)")


@dataclass(frozen=True)
class ResumeSource:
    """The checkpoint a resume would read: where it is and its metadata.json."""
    path: str
    meta: dict

    @classmethod
    def from_load(cls, load_dir: str) -> Optional["ResumeSource"]:
        """What `--load` resumes from; None when it holds no checkpoint (the run starts from scratch). In a
        --ckpt-format torch_dist directory that is ours in DIR/llamapipe (megatron_resume.source)."""
        from llamapipe.training.checkpointing.megatron_resume import source
        _, directory = source(load_dir) if os.path.isdir(load_dir) else ("ours", load_dir)
        found = choose_checkpoint(directory, verify=False)     # a Megatron save: one line saying to convert it
        return None if found is None else cls(found[1], cio.read_metadata(found[1]))

    @classmethod
    def from_metadata(cls, path: str) -> "ResumeSource":
        """A saved metadata.json, standing for the checkpoint directory it came from."""
        try:
            with open(path) as fh:
                meta = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--dry-run-checkpoint-layout {path} is not a readable metadata.json ({exc})") from None
        for key in ("model_config", "tensors", "layout", "has_optimizer"):
            if key not in meta:
                raise ValueError(f"--dry-run-checkpoint-layout {path} has no {key!r}: it is not a checkpoint's "
                                 "metadata.json")
        return cls(os.path.dirname(os.path.abspath(path)), meta)

    def layout_text(self) -> str:
        layout = self.meta["layout"]
        axes = " x ".join(f"{axis} {layout.get(axis, 1)}" for axis in ("tp", "cp", "pp", "dp"))
        return f"iteration {self.meta.get('iteration', '?')}, saved at {axes}, vpp {layout.get('vpp', 1)}"

    def check(self, chunks: list[torch.nn.Module], config: Config) -> ResumeReads:
        """What this role reads to resume (raises the real load's ValueError when it would refuse)."""
        ckpt = config.checkpoint
        load_optim = not (ckpt.finetune or ckpt.no_load_optim)
        tensors = named_tensors(chunks)
        check_loadable(self.meta, self.path, tensors, config.model, optimizer=load_optim)
        keys = [f"model:{name}" for name in tensors]
        if load_optim:
            keys += [k for k in self.meta["tensors"] if k.startswith("optim:")
                     and k.split(":", 1)[1].rsplit("/", 1)[0] in trainable(tensors)]
        files, read, kept = set(), 0, 0
        for key in keys:
            entry = self.meta["tensors"][key]
            shards = [entry["shards"][r] for r in sorted(entry["shards"], key=int)]
            files.update(shards if entry["partition_dim"] >= 0 else shards[:1])
            width = _ITEMSIZE[entry["dtype"]]
            read += torch.Size(entry["shape"]).numel() * width
            kept += tensors[key.split(":", 1)[1].rsplit("/", 1)[0]].numel() * width
        return ResumeReads(len(files), read, kept)
