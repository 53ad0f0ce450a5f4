"""On-disk checkpoint format: shard files, metadata, safe reading, and model-only checkpoints without processes.

Layout of `<save>/iter_0000010/` (docs/checkpoints.md):
  model_tp00_pp000.safetensors   one per (tp_rank, pp_rank); tensors keyed by logical name
  optim_tp00_pp000.safetensors   same, keys "<logical name>/<field>" (exp_avg, exp_avg_sq, master_param)
  optim_common.pt                optimizer step and loss-scaler state (torch.save, weights-only types)
  rng_rank00000.pt               one per global rank
  metadata.json                  written last: iteration, config, layout, tensor index, file sizes and sha256
Commit, tracker, completeness and pruning are in catalog.py (re-exported here); checksums in integrity.py.
Only safetensors and weights-only torch.load are used, so reading a checkpoint never executes code.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Optional

import torch
from safetensors import SafetensorError, safe_open

from llamapipe.training.checkpointing.catalog import (  # noqa: F401  (this module's API since format 1)
    FORMAT_VERSION, METADATA, TRACKER, commit, incomplete_reason, iter_dir, latest_checkpoint, list_iterations,
    prune, read_metadata, read_tracker, remove_tmp_dir, seal)
from llamapipe.training.checkpointing.integrity import verify_files, write_json, write_safetensors, write_torch
from llamapipe.training.checkpointing.resharding import TensorSpec, merge_shards, pp_rank_of, split_shard

OPTIM_COMMON = "optim_common.pt"
_SHARD = re.compile(r"^(model|optim)_tp(\d+)_pp(\d+)\.safetensors$")


def shard_name(kind: str, tp_rank: int, pp_rank: int) -> str:
    return f"{kind}_tp{tp_rank:02d}_pp{pp_rank:03d}.safetensors"


def rng_name(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def write_shard_file(path: str, tensors: dict[str, torch.Tensor], specs: dict[str, TensorSpec],
                     tp_rank: int, pp_rank: int, rank: int = 0) -> dict:
    """Write one safetensors shard (per-key partition specs in the header); returns its checksum record."""
    seen: set[int] = set()
    plain = {}
    for key, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        if t.data_ptr() in seen:  # tied weights share storage: store two copies, as safetensors requires
            t = t.clone()
        seen.add(t.data_ptr())
        plain[key] = t
    return write_safetensors(path, plain, shard_metadata(tensors, specs, tp_rank, pp_rank), rank)


def shard_metadata(tensors: dict[str, torch.Tensor], specs: dict[str, TensorSpec], tp_rank: int,
                   pp_rank: int) -> dict[str, str]:
    """The header metadata of one shard file: its position and every key's partition spec."""
    return {"tp_rank": str(tp_rank), "pp_rank": str(pp_rank),
            "specs": json.dumps({k: [specs[k].partition_dim, specs[k].vocab_padded] for k in tensors})}


def torch_save(obj: Any, path: str, rank: int = 0) -> dict:
    """torch.save of plain containers, numbers and tensors only (loadable with weights_only=True)."""
    return write_torch(path, obj, rank)


def safe_torch_load(path: str) -> Any:
    """Weights-only torch.load; anything else (e.g. a pickled object with code) is refused unrun."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"refusing to load checkpoint file {path}: it is not a weights-only file ({first})") from None


def open_safetensors(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"checkpoint file {path} is not a valid safetensors file ({exc})") from None


def _index_shards(ckpt_dir: str, files: list[str], vocab_size: int) -> dict[str, dict]:
    """Tensor index for metadata.json: key -> spec, logical shape, dtype and shard files by tp rank."""
    index: dict[str, dict] = {}
    for fname in sorted(files):
        match = _SHARD.match(fname)
        if not match:
            continue
        kind, tp_rank = match.group(1), int(match.group(2))
        handle = open_safetensors(os.path.join(ckpt_dir, fname))
        specs = json.loads(handle.metadata()["specs"])
        for key in handle.keys():
            part, padded = specs[key]
            entry = index.setdefault(f"{kind}:{key}", {"partition_dim": part, "vocab_padded": padded,
                                                       "dtype": handle.get_slice(key).get_dtype(), "shards": {}})
            entry["shards"].setdefault(str(tp_rank), fname)  # tied copies on later pp ranks are redundant
            entry.setdefault("shard_shapes", {})[str(tp_rank)] = handle.get_slice(key).get_shape()
    for key, entry in index.items():
        shapes = [entry["shard_shapes"][r] for r in sorted(entry["shard_shapes"], key=int)]
        shape = list(shapes[0])
        if entry["partition_dim"] >= 0:
            shape[entry["partition_dim"]] = sum(s[entry["partition_dim"]] for s in shapes)
        if entry["vocab_padded"]:
            shape[0] = vocab_size
        entry["shape"] = shape
        del entry["shard_shapes"]
    return index


def write_metadata(ckpt_dir: str, files: dict[str, dict], **fields: Any) -> dict:
    """Index the shards and write metadata.json (fsynced) with every file's checksum record in `files`."""
    meta = {"format_version": FORMAT_VERSION, **fields,
            "tensors": _index_shards(ckpt_dir, list(files), fields["model_config"]["vocab_size"]),
            "files": files}
    meta = seal(meta)
    write_json(os.path.join(ckpt_dir, METADATA), meta)
    return meta


class CheckpointReader:
    """Reads logical tensors from one complete checkpoint dir, opening only the shard files needed."""

    def __init__(self, ckpt_dir: str):
        reason = incomplete_reason(ckpt_dir)
        if reason is not None:
            raise ValueError(f"checkpoint {ckpt_dir} is incomplete: {reason}")
        self.path = ckpt_dir
        self.meta: dict = read_metadata(ckpt_dir)
        self._handles: dict[str, Any] = {}

    def keys(self, kind: str = "model") -> list[str]:
        return [k.split(":", 1)[1] for k in self.meta["tensors"] if k.startswith(kind + ":")]

    def has(self, key: str, kind: str = "model") -> bool:
        return f"{kind}:{key}" in self.meta["tensors"]

    def spec(self, key: str, kind: str = "model") -> TensorSpec:
        entry = self.meta["tensors"][f"{kind}:{key}"]
        return TensorSpec(entry["partition_dim"], entry["vocab_padded"])

    def logical(self, key: str, kind: str = "model", padded_rows: Optional[int] = None) -> torch.Tensor:
        """The full logical tensor: shards concatenated along partition_dim, vocabulary rows trimmed.

        With `padded_rows` equal to the saved padded size (same tp), padding rows are kept as saved,
        so a same-layout resume is exact even for padding rows the model trains.
        """
        entry = self.meta["tensors"][f"{kind}:{key}"]
        files = [entry["shards"][r] for r in sorted(entry["shards"], key=int)]
        if entry["partition_dim"] < 0:
            files = files[:1]
        shards = [self._handle(f).get_tensor(key) for f in files]
        spec = self.spec(key, kind)
        if spec.vocab_padded and padded_rows is not None:
            full = merge_shards(shards, TensorSpec(spec.partition_dim), 0)
            if full.shape[0] == padded_rows:
                return full
        full = merge_shards(shards, spec, self.meta["model_config"]["vocab_size"])
        assert list(full.shape) == entry["shape"], f"{key}: {list(full.shape)} != {entry['shape']}"
        return full

    def _handle(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = open_safetensors(os.path.join(self.path, fname))
        return self._handles[fname]

    def load_pt(self, fname: str) -> Any:
        return safe_torch_load(os.path.join(self.path, fname))


def open_checkpoint(load: str) -> tuple[str, CheckpointReader]:
    """(checkpoint dir, its reader) for `load`: one iter dir (it holds metadata.json), else the newest complete
    checkpoint of the save directory `load`; ValueError, one line, when there is none."""
    if os.path.isfile(os.path.join(load, METADATA)):
        path = load
    else:
        found = latest_checkpoint(load)
        if found is None:
            raise ValueError(f"--load {load} holds no complete checkpoint")
        path = found[1]
    return path, CheckpointReader(path)


def read_model_state_dict(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Any complete checkpoint -> the full logical (tp=1, unpadded) model state dict (model files verified)."""
    reader = CheckpointReader(ckpt_dir)
    defect = verify_files(ckpt_dir, reader.meta["files"], {f for f in reader.meta["files"] if f.startswith("model_")})
    if defect is not None:
        raise ValueError(f"checkpoint {ckpt_dir} is damaged: {defect}")
    return {key: reader.logical(key) for key in reader.keys("model")}


def write_layout(save_dir: str, iteration: int, state_dict: dict[str, torch.Tensor], specs: dict[str, TensorSpec],
                 model_config: dict, *, tp: int, pp: int, vpp: int = 1, config: Optional[dict] = None,
                 progress: Optional[Iterable] = None, consumed_samples: int = 0, optim: Optional[dict] = None,
                 scheduler: Optional[dict] = None) -> str:
    """Write a full logical state dict as a (tp, pp, vpp) checkpoint, no processes needed: model-only, or with
    optimizer state `optim` = {"param_state": {name: {field: full tensor}}, "step": n, "grad_scaler": {}}
    (Optimizer.state_dict's form) and the LR `scheduler`'s state_dict.

    `progress` wraps the (pp_rank, tp_rank) loop (e.g. tqdm). Returns the committed checkpoint dir.
    """
    vocab, multiple = model_config["vocab_size"], model_config["make_vocab_size_divisible_by"] * tp
    padded_rows = -(-vocab // multiple) * multiple
    tmp = iter_dir(save_dir, iteration) + ".tmp"
    remove_tmp_dir(tmp)
    os.makedirs(tmp)
    owner = {name: pp_rank_of(name, model_config["num_layers"], pp, vpp) for name in state_dict}
    grid = [(p, t) for p in range(pp) for t in range(tp)]
    files = {}
    for pp_rank, tp_rank in (progress(grid) if progress else grid):
        names = [n for n in state_dict if owner[n] == pp_rank]
        shards = {n: split_shard(state_dict[n][:vocab] if specs[n].vocab_padded else state_dict[n],
                                 specs[n], tp, tp_rank, padded_rows) for n in names}
        fname = shard_name("model", tp_rank, pp_rank)
        files[fname] = write_shard_file(os.path.join(tmp, fname), shards, specs, tp_rank, pp_rank,
                                        rank=pp_rank * tp + tp_rank)   # the tp-cp-dp-pp rank of (tp_rank, pp_rank)
        if optim is not None:
            fields = {f"{n}/{field}": (n, t) for n in names for field, t in optim["param_state"][n].items()}
            shards = {key: split_shard(t[:vocab] if specs[n].vocab_padded else t, specs[n], tp, tp_rank, padded_rows)
                      for key, (n, t) in fields.items()}
            fname = shard_name("optim", tp_rank, pp_rank)
            files[fname] = write_shard_file(os.path.join(tmp, fname), shards, {k: specs[n] for k, (n, _) in
                                                                              fields.items()}, tp_rank, pp_rank)
    if optim is not None:
        files[OPTIM_COMMON] = write_torch(os.path.join(tmp, OPTIM_COMMON),
                                          {k: v for k, v in optim.items() if k != "param_state"}, 0)
    layout = {"world_size": tp * pp, "tp": tp, "cp": 1, "pp": pp, "vpp": vpp, "dp": 1, "order": "tp-cp-dp-pp"}
    write_metadata(tmp, files, iteration=iteration, consumed_samples=consumed_samples, model_config=model_config,
                   config=config, layout=layout, has_optimizer=optim is not None, scheduler=scheduler)
    return commit(tmp, save_dir, iteration)
