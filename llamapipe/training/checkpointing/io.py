"""On-disk checkpoint format: shard files, metadata, atomic commit, completeness checks, safe reading.

Layout of `<save>/iter_0000010/` (docs/checkpoints.md):
  model_tp00_pp000.safetensors   one per (tp_rank, pp_rank); tensors keyed by logical name
  optim_tp00_pp000.safetensors   same, keys "<logical name>/<field>" (exp_avg, exp_avg_sq, master_param)
  optim_common.pt                optimizer step and loss-scaler state (torch.save, weights-only types)
  rng_rank00000.pt               one per global rank
  metadata.json                  written last: iteration, config, layout, tensor index, file sizes
A save goes to `iter_XXXXXXX.tmp/` and is renamed into place after metadata.json is fsynced; the
tracker `latest_checkpointed_iteration.txt` is replaced last. Only safetensors and weights-only
torch.load are used, so reading a checkpoint never executes code.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Iterable, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from llamapipe.core.logger import get_logger
from llamapipe.training.checkpointing.resharding import TensorSpec, merge_shards, pp_rank_of, split_shard

FORMAT_VERSION = 1
METADATA = "metadata.json"
TRACKER = "latest_checkpointed_iteration.txt"
OPTIM_COMMON = "optim_common.pt"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_SHARD = re.compile(r"^(model|optim)_tp(\d+)_pp(\d+)\.safetensors$")


def iter_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def shard_name(kind: str, tp_rank: int, pp_rank: int) -> str:
    return f"{kind}_tp{tp_rank:02d}_pp{pp_rank:03d}.safetensors"


def rng_name(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard_file(path: str, tensors: dict[str, torch.Tensor], specs: dict[str, TensorSpec],
                     tp_rank: int, pp_rank: int) -> None:
    """Write one safetensors shard; per-key partition specs travel in the header."""
    seen: set[int] = set()
    plain = {}
    for key, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        if t.data_ptr() in seen:  # tied weights share storage, which safetensors refuses
            t = t.clone()
        seen.add(t.data_ptr())
        plain[key] = t
    header = {"tp_rank": str(tp_rank), "pp_rank": str(pp_rank),
              "specs": json.dumps({k: [specs[k].partition_dim, specs[k].vocab_padded] for k in tensors})}
    save_file(plain, path, metadata=header)
    _fsync_path(path)


def torch_save(obj: Any, path: str) -> None:
    """torch.save of plain containers, numbers and tensors only (loadable with weights_only=True)."""
    torch.save(obj, path)
    _fsync_path(path)


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


def write_metadata(ckpt_dir: str, **fields: Any) -> dict:
    """Index every file in `ckpt_dir` and write metadata.json (fsynced). Call after all shards exist."""
    files = sorted(f for f in os.listdir(ckpt_dir) if f != METADATA)
    meta = {"format_version": FORMAT_VERSION, **fields,
            "tensors": _index_shards(ckpt_dir, files, fields["model_config"]["vocab_size"]),
            "files": {f: os.path.getsize(os.path.join(ckpt_dir, f)) for f in files}}
    path = os.path.join(ckpt_dir, METADATA)
    with open(path, "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    return meta


def commit(tmp_dir: str, save_dir: str, iteration: int) -> str:
    """Rename the finished tmp dir into place, then point the tracker at it (both atomic)."""
    final = iter_dir(save_dir, iteration)
    if os.path.exists(final):  # re-saving an iteration: the old copy goes only once the new one is whole
        shutil.rmtree(final)
    os.replace(tmp_dir, final)
    _fsync_path(save_dir)
    tmp_tracker = os.path.join(save_dir, TRACKER + ".tmp")
    with open(tmp_tracker, "w") as fh:
        fh.write(f"{iteration}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp_tracker, os.path.join(save_dir, TRACKER))
    _fsync_path(save_dir)
    return final


def incomplete_reason(ckpt_dir: str) -> Optional[str]:
    """None when `ckpt_dir` is a complete checkpoint, else why not (one phrase)."""
    try:
        with open(os.path.join(ckpt_dir, METADATA)) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return "metadata.json is missing or unreadable"
    if meta.get("format_version") != FORMAT_VERSION:
        return f"format version {meta.get('format_version')} is not {FORMAT_VERSION}"
    for fname, size in meta["files"].items():
        path = os.path.join(ckpt_dir, fname)
        if not os.path.isfile(path):
            return f"{fname} is missing"
        if os.path.getsize(path) != size:
            return f"{fname} has {os.path.getsize(path)} bytes, metadata says {size}"
    return None


def list_iterations(save_dir: str) -> list[int]:
    """Iterations of all committed (renamed) checkpoint dirs, ascending; complete or not."""
    if not os.path.isdir(save_dir):
        return []
    found = (_ITER_DIR.match(name) for name in os.listdir(save_dir))
    return sorted(int(m.group(1)) for m in found if m)


def read_tracker(save_dir: str) -> Optional[int]:
    try:
        with open(os.path.join(save_dir, TRACKER)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def latest_checkpoint(load_dir: str) -> Optional[tuple[int, str]]:
    """Newest complete checkpoint as (iteration, path); incomplete newer ones are skipped with a warning."""
    log = get_logger()
    for iteration in reversed(list_iterations(load_dir)):
        path = iter_dir(load_dir, iteration)
        reason = incomplete_reason(path)
        if reason is None:
            tracked = read_tracker(load_dir)
            if tracked is not None and tracked != iteration:
                log.warning(f"{load_dir}/{TRACKER} names iteration {tracked}; using the newest complete "
                            f"checkpoint {path}")
            return iteration, path
        log.warning(f"skipping incomplete checkpoint {path}: {reason}")
    return None


def prune(save_dir: str, keep_last_n: int) -> None:
    """Delete complete checkpoints older than the newest `keep_last_n` complete ones."""
    complete = [i for i in list_iterations(save_dir) if incomplete_reason(iter_dir(save_dir, i)) is None]
    for iteration in complete[:-keep_last_n] if keep_last_n > 0 else complete:
        shutil.rmtree(iter_dir(save_dir, iteration))


class CheckpointReader:
    """Reads logical tensors from one complete checkpoint dir, opening only the shard files needed."""

    def __init__(self, ckpt_dir: str):
        reason = incomplete_reason(ckpt_dir)
        if reason is not None:
            raise ValueError(f"checkpoint {ckpt_dir} is incomplete: {reason}")
        self.path = ckpt_dir
        with open(os.path.join(ckpt_dir, METADATA)) as fh:
            self.meta: dict = json.load(fh)
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


def read_model_state_dict(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Any complete checkpoint -> the full logical (tp=1, unpadded) model state dict."""
    reader = CheckpointReader(ckpt_dir)
    return {key: reader.logical(key) for key in reader.keys("model")}


def write_layout(save_dir: str, iteration: int, state_dict: dict[str, torch.Tensor], specs: dict[str, TensorSpec],
                 model_config: dict, *, tp: int, pp: int, vpp: int = 1, config: Optional[dict] = None,
                 progress: Optional[Iterable] = None) -> str:
    """Write a full logical state dict as a (tp, pp, vpp) model-only checkpoint, no processes needed.

    `progress` wraps the (pp_rank, tp_rank) loop (e.g. tqdm). Returns the committed checkpoint dir.
    """
    vocab, multiple = model_config["vocab_size"], model_config["make_vocab_size_divisible_by"] * tp
    padded_rows = -(-vocab // multiple) * multiple
    tmp = iter_dir(save_dir, iteration) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    owner = {name: pp_rank_of(name, model_config["num_layers"], pp, vpp) for name in state_dict}
    grid = [(p, t) for p in range(pp) for t in range(tp)]
    for pp_rank, tp_rank in (progress(grid) if progress else grid):
        names = [n for n in state_dict if owner[n] == pp_rank]
        shards = {n: split_shard(state_dict[n][:vocab] if specs[n].vocab_padded else state_dict[n],
                                 specs[n], tp, tp_rank, padded_rows) for n in names}
        write_shard_file(os.path.join(tmp, shard_name("model", tp_rank, pp_rank)), shards, specs, tp_rank, pp_rank)
    layout = {"world_size": tp * pp, "tp": tp, "pp": pp, "vpp": vpp, "dp": 1, "order": "tp-dp-pp"}
    write_metadata(tmp, iteration=iteration, consumed_samples=0, model_config=model_config, config=config,
                   layout=layout, has_optimizer=False, scheduler=None)
    return commit(tmp, save_dir, iteration)
