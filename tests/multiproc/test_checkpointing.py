"""Checkpoint library on toy modules: resharding between layouts, optimizer state, atomic saves after a
crash, safe loading of a malicious pickle, keep-last-n. The toy chunks carry the model's partition
attributes (tensor_model_parallel, partition_dim, vocab_padded) and logical names."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from llamapipe.training.checkpointing import io as cio
from llamapipe.training.checkpointing.save_load import LoadResult, latest_checkpoint, load_checkpoint, save_checkpoint
from llamapipe.training.config import Config
from llamapipe.core.parallel_state import ParallelState, RankGrid
from llamapipe.model.llama import LlamaConfig
from tests.harness import ROOT, run_distributed

CFG = LlamaConfig(num_layers=4, hidden_size=8, ffn_hidden_size=12, num_attention_heads=2, num_query_groups=2,
                  vocab_size=50, make_vocab_size_divisible_by=4)
CONFIG = Config(model=CFG)
# name pattern -> (logical shape, partition_dim, vocab_padded)
SHAPES = {"embedding.weight": ((50, 8), 0, True), "qkv.weight": ((12, 8), 0, False),
          "proj.weight": ((8, 8), 1, False), "norm.weight": ((8,), -1, False),
          "final_norm.weight": ((8,), -1, False), "output.weight": ((50, 8), 0, True)}


def reference(name: str) -> torch.Tensor:
    """Full logical tensor for `name`, seeded by the name alone (layout-independent)."""
    shape = SHAPES[name if name in SHAPES else name.split(".", 2)[2]][0]
    gen = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(name)))
    return torch.randn(shape, generator=gen)


def local_shard(full: torch.Tensor, part: int, padded: bool, tp: int, tp_rank: int) -> torch.Tensor:
    if padded:
        rows = CFG.padded_vocab_size(tp)
        full = torch.cat([full, full.new_zeros(rows - full.shape[0], full.shape[1])])
    if part < 0:
        return full.clone()
    step = full.shape[part] // tp
    return full.narrow(part, tp_rank * step, step).clone()


def _param(name: str, tp: int, tp_rank: int, fill: float | None) -> nn.Parameter:
    _, part, padded = SHAPES[name if name in SHAPES else name.split(".", 2)[2]]
    data = local_shard(reference(name), part, padded, tp, tp_rank)
    param = nn.Parameter(data if fill is None else torch.full_like(data, fill))
    param.tensor_model_parallel, param.partition_dim, param.vocab_padded = part >= 0, part, padded
    return param


class ToyChunk(nn.Module):
    """Holds embedding (first stage), layers [start, end) under global indices, head (last stage)."""

    def __init__(self, ps: ParallelState, stage: int, fill: float | None = None):
        super().__init__()
        stages = ps.pp_size * ps.vpp_size
        per = CFG.num_layers // stages
        tp, r = ps.tp_size, ps.tp_rank
        if stage == 0:
            self.embedding = nn.Module()
            self.embedding.weight = _param("embedding.weight", tp, r, fill)
        self.layers = nn.ModuleDict()
        for i in range(stage * per, (stage + 1) * per):
            layer = nn.Module()
            for sub in ("qkv", "proj", "norm"):
                setattr(layer, sub, nn.Module())
                getattr(layer, sub).weight = _param(f"layers.{i}.{sub}.weight", tp, r, fill)
            self.layers[str(i)] = layer
        if stage == stages - 1:
            self.final_norm, self.output = nn.Module(), nn.Module()
            self.final_norm.weight = _param("final_norm.weight", tp, r, fill)
            self.output.weight = _param("output.weight", tp, r, fill)


class FakeOptimizer:
    """Per-parameter state in local shard shapes, like core/optimizer's state_dict contract."""

    def __init__(self, chunks: list[nn.Module], step: int = 7):
        self.state = {"param_state": {}, "step": step, "grad_scaler": {"scale": torch.tensor(1024.0)}}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                self.state["param_state"][name] = {"exp_avg": p.detach() * 2, "exp_avg_sq": p.detach() ** 2}

    def state_dict(self, *, keep: bool = True) -> dict:
        """Copies the caller owns, as core/optimizer's state_dict returns."""
        if not keep:
            return {}
        return {**self.state, "param_state": {n: {f: t.clone() for f, t in fields.items()}
                                              for n, fields in self.state["param_state"].items()}}

    def load_state_dict(self, state: dict) -> None:
        self.state = state

    def reload_model_params(self) -> None:
        self.reloaded = True


class FakeScheduler:
    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self) -> dict:
        return {"num_steps": self.step, "max_lr": 3e-4}

    def load_state_dict(self, state: dict, **rule) -> None:
        self.step = state["num_steps"]


def make_state(rank: int, world: int, tp: int, pp: int, vpp: int) -> ParallelState:
    grid = RankGrid(world, tp, pp)
    c = grid.coords(rank)
    return ParallelState(rank=rank, world_size=world, tp_size=tp, pp_size=pp, dp_size=grid.dp, vpp_size=vpp,
                         tp_rank=c["tp"], pp_rank=c["pp"], dp_rank=c["dp"])


def make_chunks(ps: ParallelState, fill: float | None = None) -> list[nn.Module]:
    return [ToyChunk(ps, chunk * ps.pp_size + ps.pp_rank, fill) for chunk in range(ps.vpp_size)]


def local_state(chunks: list[nn.Module], optimizer: FakeOptimizer) -> dict:
    params = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    optim = {n: {f: t.clone() for f, t in fields.items()} for n, fields in optimizer.state["param_state"].items()}
    return {"params": params, "optim": optim}


def _save_then_reshard(rank: int, world: int, save_dir: str) -> dict:
    """Save from tp=2 pp=2, then load into tp=1 pp=2 vpp=2 dp=2 (chunks start filled with -1)."""
    ps = make_state(rank, world, 2, 2, 1)
    chunks = make_chunks(ps)
    save_checkpoint(save_dir, 5, model_chunks=chunks, optimizer=FakeOptimizer(chunks), scheduler=FakeScheduler(5),
                    parallel_state=ps, config=CONFIG, consumed_samples=40)
    ps2 = make_state(rank, world, 1, 2, 2)
    chunks2 = make_chunks(ps2, fill=-1.0)
    optimizer, scheduler = FakeOptimizer(chunks2, step=0), FakeScheduler()
    result = load_checkpoint(save_dir, model_chunks=chunks2, optimizer=optimizer, scheduler=scheduler,
                             parallel_state=ps2, config=CONFIG)
    state = local_state(chunks2, optimizer)  # numpy: torch tensors would travel through shared memory
    state = {"params": {n: t.numpy() for n, t in state["params"].items()},
             "optim": {n: {f: t.numpy() for f, t in fields.items()} for n, fields in state["optim"].items()}}
    return {"result": result, "scheduler_step": scheduler.step, **state}


def expected_local(name: str, tp: int, tp_rank: int) -> torch.Tensor:
    _, part, padded = SHAPES[name if name in SHAPES else name.split(".", 2)[2]]
    return local_shard(reference(name), part, padded, tp, tp_rank)


def check_loaded(state: dict, tp: int, tp_rank: int) -> None:
    """Loaded params and optimizer state equal the reference split for this layout (bit-exact)."""
    assert state["params"], "rank holds no parameters"
    for name, value in state["params"].items():
        want = expected_local(name, tp, tp_rank)
        assert torch.equal(value, want), name
        assert torch.equal(state["optim"][name]["exp_avg"], want * 2), name
        assert torch.equal(state["optim"][name]["exp_avg_sq"], want ** 2), name


@pytest.mark.slow
def test_save_tp2_pp2_reshard_everywhere(tmp_path):
    results = run_distributed(_save_then_reshard, 4, str(tmp_path), timeout=120)
    for state in results:
        state["params"] = {n: torch.from_numpy(a) for n, a in state["params"].items()}
        state["optim"] = {n: {f: torch.from_numpy(a) for f, a in d.items()} for n, d in state["optim"].items()}
        assert state["result"] == LoadResult(5, 40) and state["scheduler_step"] == 5
        check_loaded(state, 1, 0)
    names = set().union(*(r["params"] for r in results))
    assert names == {n for n in cio.read_model_state_dict(str(tmp_path / "iter_0000005"))}
    full = cio.read_model_state_dict(str(tmp_path / "iter_0000005"))
    assert all(torch.equal(full[n], reference(n)) for n in full)
    # Other layouts, loaded rank by rank in this process (loading needs no process groups).
    for tp, pp, vpp in ((1, 1, 1), (2, 1, 1), (2, 4, 1), (1, 1, 4)):
        for rank in range(tp * pp):
            ps = make_state(rank, tp * pp, tp, pp, vpp)
            chunks = make_chunks(ps, fill=3.0)
            optimizer = FakeOptimizer(chunks, step=0)
            assert load_checkpoint(str(tmp_path), model_chunks=chunks, optimizer=optimizer, scheduler=None,
                                   parallel_state=ps, config=CONFIG, no_load_rng=True) == LoadResult(5, 40)
            assert optimizer.state["step"] == 7 and optimizer.state["grad_scaler"]["scale"].item() == 1024.0
            check_loaded(local_state(chunks, optimizer), tp, ps.tp_rank)


def _save_single(save_dir: str, iteration: int, chunks: list[nn.Module], keep_last_n: int | None = None) -> None:
    save_checkpoint(save_dir, iteration, model_chunks=chunks, optimizer=FakeOptimizer(chunks),
                    scheduler=FakeScheduler(iteration), parallel_state=None, config=CONFIG,
                    consumed_samples=iteration * 8, keep_last_n=keep_last_n)


def test_same_layout_roundtrip_is_exact_and_restores_rng(tmp_path):
    chunks = make_chunks(ParallelState())
    with torch.no_grad():  # padding rows that training touched must survive a same-layout resume
        chunks[0].output.weight[-1].fill_(0.5)
    torch.manual_seed(3)
    _save_single(str(tmp_path), 1, chunks)
    expected_draw = torch.rand(4)
    loaded = make_chunks(ParallelState(), fill=0.0)
    optimizer = FakeOptimizer(loaded, step=0)
    load_checkpoint(str(tmp_path), model_chunks=loaded, optimizer=optimizer, scheduler=None, parallel_state=None,
                    config=CONFIG)
    assert torch.equal(torch.rand(4), expected_draw)
    for (name, p), q in zip(chunks[0].named_parameters(), loaded[0].parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(optimizer.state["param_state"][name]["exp_avg"], p.detach() * 2), name


class Evil:
    """A pickle payload that would create `marker` when unpickled by a full (unsafe) loader."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _plant(ckpt: pathlib.Path, fname: str, payload: object) -> None:
    torch.save(payload, ckpt / fname)
    meta = json.loads((ckpt / "metadata.json").read_text())
    meta["files"][fname] = (ckpt / fname).stat().st_size   # an attacker rewrites the metadata to match
    (ckpt / "metadata.json").write_text(json.dumps(cio.seal(meta)))


@pytest.mark.parametrize("fname", ["optim_common.pt", "rng_rank00000.pt", "model_tp00_pp000.safetensors"])
def test_malicious_pickle_is_refused_unrun(tmp_path, fname):
    chunks = make_chunks(ParallelState())
    _save_single(str(tmp_path / "ckpt"), 1, chunks)
    marker = tmp_path / "pwned"
    _plant(tmp_path / "ckpt" / "iter_0000001", fname, {"state": Evil(str(marker))})
    with pytest.raises(ValueError) as info:
        load_checkpoint(str(tmp_path / "ckpt"), model_chunks=make_chunks(ParallelState()),
                        optimizer=FakeOptimizer(chunks), scheduler=None, parallel_state=None, config=CONFIG)
    assert not marker.exists(), "unpickling executed code"
    message = str(info.value)
    assert fname in message and "\n" not in message


_CRASHING_SAVE = """
import os, sys
sys.path.insert(0, {root!r})
import llamapipe.training.checkpointing.save_load as ck
from llamapipe.core.parallel_state import ParallelState
from tests.multiproc.test_checkpointing import _save_single, make_chunks
ck.cio.torch_save = lambda *args: os._exit(3)   # die after the model shard, before rng/metadata
_save_single({save_dir!r}, 2, make_chunks(ParallelState(), fill=2.0))
"""


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    save_dir = str(tmp_path)
    _save_single(save_dir, 1, make_chunks(ParallelState()))
    proc = subprocess.run([sys.executable, "-c", _CRASHING_SAVE.format(root=ROOT, save_dir=save_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert os.path.isfile(tmp_path / "iter_0000002.tmp" / "model_tp00_pp000.safetensors")
    # A committed dir whose shard was truncated afterwards is incomplete too.
    _save_single(save_dir, 3, make_chunks(ParallelState(), fill=3.0))
    shard = tmp_path / "iter_0000003" / "model_tp00_pp000.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    (tmp_path / cio.TRACKER).write_text("1\n")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("llamapipe").addHandler(handler)
    try:
        assert latest_checkpoint(save_dir) == (1, str(tmp_path / "iter_0000001"))
        loaded = make_chunks(ParallelState(), fill=0.0)
        assert load_checkpoint(save_dir, model_chunks=loaded, optimizer=None, scheduler=None,
                               parallel_state=None, config=CONFIG) == LoadResult(1, 8)
    finally:
        logging.getLogger("llamapipe").removeHandler(handler)
    assert any("iter_0000003" in r.getMessage() and "model_tp00_pp000.safetensors has 100 bytes" in r.getMessage()
               for r in records)
    assert cio.read_tracker(save_dir) == 1
    assert torch.equal(loaded[0].output.weight[:50], reference("output.weight"))


def test_keep_last_n_keeps_exactly_n_complete(tmp_path):
    chunks = make_chunks(ParallelState())
    for iteration in (1, 2, 3, 4, 5):
        _save_single(str(tmp_path), iteration, chunks, keep_last_n=2)
    assert cio.list_iterations(str(tmp_path)) == [4, 5]
    assert all(cio.incomplete_reason(cio.iter_dir(str(tmp_path), i)) is None for i in (4, 5))
    assert cio.read_tracker(str(tmp_path)) == 5


def test_missing_optimizer_state_names_no_load_optim(tmp_path):
    chunks = make_chunks(ParallelState())
    save_checkpoint(str(tmp_path), 1, model_chunks=chunks, optimizer=None, scheduler=None, parallel_state=None,
                    config=CONFIG, consumed_samples=0)
    with pytest.raises(ValueError, match="--no-load-optim"):
        load_checkpoint(str(tmp_path), model_chunks=chunks, optimizer=FakeOptimizer(chunks), scheduler=None,
                        parallel_state=None, config=CONFIG)
    optimizer = FakeOptimizer(chunks)
    assert load_checkpoint(str(tmp_path), model_chunks=chunks, optimizer=optimizer, scheduler=None,
                           parallel_state=None, config=CONFIG, finetune=True) == LoadResult(0, 0)
    assert optimizer.reloaded, "fp32 master weights were not refreshed from the loaded model"


def test_no_checkpoint_returns_none_and_wrong_model_is_refused(tmp_path):
    chunks = make_chunks(ParallelState())
    assert load_checkpoint(str(tmp_path), model_chunks=chunks, optimizer=None, scheduler=None,
                           parallel_state=None, config=CONFIG) is None
    _save_single(str(tmp_path), 1, chunks)
    other = Config(model=CFG.replace(hidden_size=16))
    with pytest.raises(ValueError, match="hidden_size 8 but this run has 16; set --hidden-size 8"):
        load_checkpoint(str(tmp_path), model_chunks=chunks, optimizer=None, scheduler=None,
                        parallel_state=None, config=other)


_KILLED_ASYNC_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.checkpointing import integrity
from llamapipe.training.checkpointing.save_load import save_checkpoint
from tests.multiproc.test_checkpointing import CONFIG, FakeOptimizer, make_chunks
real = integrity.HashingFile.write
def write(self, data):   # SIGKILL on the background writer thread, in the middle of the optimizer shard
    if "optim_tp" in self.path:
        real(self, bytes(memoryview(data).cast("B")[:64]))
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, data)
integrity.HashingFile.write = write
chunks = make_chunks(ParallelState(), fill=2.0)
save_checkpoint({save_dir!r}, 2, model_chunks=chunks, optimizer=FakeOptimizer(chunks), scheduler=None,
                parallel_state=None, config=CONFIG, consumed_samples=16, async_save=True)
"""


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path):
    save_dir = str(tmp_path)
    _save_single(save_dir, 1, make_chunks(ParallelState()))
    proc = subprocess.run([sys.executable, "-c", _KILLED_ASYNC_SAVE.format(root=ROOT, save_dir=save_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert (tmp_path / "iter_0000002.tmp" / "model_tp00_pp000.safetensors").is_file(), "killed before writing"
    assert cio.list_iterations(save_dir) == [1] and cio.read_tracker(save_dir) == 1
    loaded = make_chunks(ParallelState(), fill=0.0)
    assert load_checkpoint(save_dir, model_chunks=loaded, optimizer=None, scheduler=None, parallel_state=None,
                           config=CONFIG) == LoadResult(1, 8)
    assert torch.equal(loaded[0].output.weight[:50], reference("output.weight"))
