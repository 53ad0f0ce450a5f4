"""Checkpoint integrity through the checkpointing API, single process on toy chunks: a flipped byte in a
model, optimizer or RNG file is detected and the previous valid checkpoint loads; every checkpoint damaged
is one error line and nothing is pruned; one file mode for all files; a full disk during a save or its
commit keeps the previous checkpoint; async save writes the same bytes as a sync save; pruning never
touches the new or a newer checkpoint; `llamapipe verify-checkpoint`."""
from __future__ import annotations

import errno
import logging
import os
import stat

import pytest
import torch

from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.checkpointing import catalog, integrity, writer
from llamapipe.training.checkpointing import io as cio
from llamapipe.training.checkpointing.save_load import (CheckpointSaveError, LoadResult, finalize_async_save,
                                                         load_checkpoint, save_checkpoint)
from llamapipe.tools import verify_checkpoint
from tests.multiproc.test_checkpointing import CONFIG, FakeOptimizer, FakeScheduler, make_chunks, reference

FILES = ["model_tp00_pp000.safetensors", "optim_tp00_pp000.safetensors", "rng_rank00000.pt"]


def save(save_dir, iteration: int, fill: float | None = None, **kw) -> None:
    chunks = make_chunks(ParallelState(), fill=fill)
    save_checkpoint(str(save_dir), iteration, model_chunks=chunks, optimizer=FakeOptimizer(chunks),
                    scheduler=FakeScheduler(iteration), parallel_state=None, config=CONFIG,
                    consumed_samples=iteration * 8, **kw)


def load(save_dir) -> tuple[LoadResult | None, list]:
    chunks = make_chunks(ParallelState(), fill=0.0)
    result = load_checkpoint(str(save_dir), model_chunks=chunks, optimizer=FakeOptimizer(chunks, step=0),
                             scheduler=FakeScheduler(), parallel_state=None, config=CONFIG)
    return result, chunks


def flip_byte(path) -> None:
    """Same size, one bit different, in the middle of the file (tensor data, not the header)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture
def warnings():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logging.getLogger("llamapipe").addHandler(handler)
    yield records
    logging.getLogger("llamapipe").removeHandler(handler)


@pytest.mark.parametrize("fname", FILES)
def test_flipped_byte_is_detected_and_the_previous_checkpoint_loads(tmp_path, fname, warnings):
    save(tmp_path, 1)
    save(tmp_path, 2, fill=2.0)
    flip_byte(tmp_path / "iter_0000002" / fname)
    assert catalog.incomplete_reason(str(tmp_path / "iter_0000002")) is None, "same size: the cheap check passes"
    result, chunks = load(tmp_path)
    assert result == LoadResult(1, 8)
    assert torch.equal(chunks[0].output.weight[:50], reference("output.weight")), "iteration 1's weights"
    text = " ".join(r.getMessage() for r in warnings)
    assert f"iter_0000002 ({fname} fails its sha256 checksum" in text, text
    assert verify_checkpoint.main([str(tmp_path / "iter_0000002")]) == 1
    assert verify_checkpoint.main([str(tmp_path / "iter_0000001")]) == 0


def test_every_checkpoint_damaged_is_one_error_line_naming_each(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    flip_byte(tmp_path / "iter_0000001" / FILES[1])
    (tmp_path / "iter_0000002" / FILES[2]).unlink()
    with pytest.raises(ValueError) as info:
        load(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert f"iter_0000002 ({FILES[2]} is missing)" in message, message
    assert f"iter_0000001 ({FILES[1]} fails its sha256 checksum" in message, message
    assert catalog.list_iterations(str(tmp_path)) == [1, 2]


def test_directory_without_checkpoints_still_starts_fresh(tmp_path):
    (tmp_path / "iter_0000003.tmp").mkdir()        # a crashed first save commits nothing
    assert load(tmp_path)[0] is None


def test_every_file_has_the_same_mode_from_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        save(tmp_path, 1)
    finally:
        os.umask(old)
    ckpt = tmp_path / "iter_0000001"
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in ckpt.iterdir()}
    assert set(modes) == set(FILES) | {"optim_common.pt", "metadata.json"}
    assert set(modes.values()) == {0o640}, modes


def _full_disk_on(fname: str, monkeypatch) -> None:
    real = integrity.HashingFile.write

    def write(self, data):
        if os.path.basename(self.path) == fname:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, data)
    monkeypatch.setattr(integrity.HashingFile, "write", write)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, async_save):
    save(tmp_path, 1, keep_last_n=1)
    _full_disk_on(FILES[1], monkeypatch)
    with pytest.raises(CheckpointSaveError) as info:
        save(tmp_path, 2, fill=2.0, keep_last_n=1, async_save=async_save)
        finalize_async_save()
    message = str(info.value)
    assert "\n" not in message and FILES[1] in message and "No space left on device (ENOSPC)" in message, message
    assert "iteration 1 is still the checkpoint that loads" in message
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", catalog.TRACKER], "tmp dir or tracker side file left"
    assert catalog.read_tracker(str(tmp_path)) == 1
    assert verify_checkpoint.main([str(tmp_path)]) == 0
    assert load(tmp_path)[0] == LoadResult(1, 8)


def test_full_disk_at_the_commit_leaves_no_half_written_tracker(tmp_path, monkeypatch):
    save(tmp_path, 1)
    real_create = catalog.create_new

    def full_create(path, mode="wb"):
        if str(path).endswith(catalog.TRACKER + ".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_create(path, mode)
    monkeypatch.setattr(catalog, "create_new", full_create)
    with pytest.raises(CheckpointSaveError, match="committing failed: No space left on device"):
        save(tmp_path, 2, fill=2.0)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", catalog.TRACKER]
    assert load(tmp_path)[0] == LoadResult(1, 8)


def test_async_save_writes_what_sync_save_writes_while_training_goes_on(tmp_path):
    chunks = make_chunks(ParallelState())
    optimizer = FakeOptimizer(chunks)
    for name, async_save in (("sync", False), ("async", True)):
        save_checkpoint(str(tmp_path / name), 3, model_chunks=chunks, optimizer=optimizer, scheduler=None,
                        parallel_state=None, config=CONFIG, consumed_samples=24, async_save=async_save)
    with torch.no_grad():          # the "next step": changes the live state while the writer may still run
        for p in chunks[0].parameters():
            p.add_(1.0)
        for fields in optimizer.state["param_state"].values():
            fields["exp_avg"].add_(1.0)
    finalize_async_save()
    metas = {name: catalog.read_metadata(str(tmp_path / name / "iter_0000003")) for name in ("sync", "async")}
    for fname in FILES[:2] + ["optim_common.pt"]:
        assert metas["sync"]["files"][fname]["sha256"] == metas["async"]["files"][fname]["sha256"], fname
    result, loaded = load(tmp_path / "async")
    assert result == LoadResult(3, 24)
    assert torch.equal(loaded[0].output.weight[:50], reference("output.weight"))


def test_prune_runs_after_the_commit_and_spares_new_and_newer_checkpoints(tmp_path, monkeypatch):
    for iteration in (1, 2, 5):
        save(tmp_path, iteration)
    save(tmp_path, 3, keep_last_n=1)        # a resumed run: 5 is newer, left by an earlier timeline
    assert catalog.list_iterations(str(tmp_path)) == [3, 5]
    _full_disk_on(FILES[0], monkeypatch)
    with pytest.raises(CheckpointSaveError):
        save(tmp_path, 4, keep_last_n=1)
    assert catalog.list_iterations(str(tmp_path)) == [3, 5], "a failed save pruned something"


def test_prune_names_a_linked_checkpoint_keeps_it_and_prunes_the_rest(tmp_path):
    """Issue 51: an iter_* entry that is a symbolic link made every save print 'pruning failed' without naming it,
    and nothing more was pruned (the disk filled). Now it is named and kept (its target too), the rest pruned."""
    save_dir, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    for iteration in (1, 2, 3):
        save(save_dir, iteration)
    elsewhere.mkdir()
    os.rename(save_dir / "iter_0000001", elsewhere / "iter_0000001")
    (save_dir / "iter_0000001").symlink_to(elsewhere / "iter_0000001")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logging.getLogger("llamapipe").addHandler(handler)
    try:
        save(save_dir, 4, keep_last_n=1)
    finally:
        logging.getLogger("llamapipe").removeHandler(handler)
    assert catalog.list_iterations(str(save_dir)) == [1, 4] and (elsewhere / "iter_0000001" / catalog.METADATA).exists()
    said = [r.getMessage() for r in records if "iter_0000001" in r.getMessage()]
    assert said == [f"--keep-last-n 1: kept {save_dir / 'iter_0000001'}: {save_dir / 'iter_0000001'} is a symbolic "
                    "link, not a checkpoint directory of this run; pruning removes neither it nor its target (remove "
                    "the link yourself)"], [r.getMessage() for r in records]


def test_pending_save_is_finalized_by_the_next_save(tmp_path):
    save(tmp_path, 1, async_save=True)
    assert writer.pending_iteration() == 1
    save(tmp_path, 2, async_save=True)
    assert writer.pending_iteration() == 2 and catalog.read_tracker(str(tmp_path)) in (1, 2)
    finalize_async_save()
    assert writer.pending_iteration() is None and catalog.read_tracker(str(tmp_path)) == 2


def test_verify_checkpoint_reports_unlisted_files_and_needs_a_checkpoint(tmp_path, capsys):
    save(tmp_path, 1)
    (tmp_path / "iter_0000001" / "stray.bin").write_bytes(b"x")
    assert verify_checkpoint.main([str(tmp_path)]) == 1
    assert "stray.bin is not listed in metadata.json" in capsys.readouterr().out
    assert verify_checkpoint.main([str(tmp_path / "nothing")]) == 2
    assert "is not a checkpoint and holds none" in capsys.readouterr().err


def test_checkpoint_written_by_format_1_still_loads(tmp_path):
    save(tmp_path, 1)
    meta = catalog.read_metadata(str(tmp_path / "iter_0000001"))
    meta["format_version"], meta["files"] = 1, {f: r["size"] for f, r in meta["files"].items()}
    integrity.write_json(str(tmp_path / "iter_0000001" / cio.METADATA), meta)
    assert load(tmp_path)[0] == LoadResult(1, 8)


def test_changed_metadata_is_detected(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    path = tmp_path / "iter_0000002" / cio.METADATA
    path.write_text(path.read_text().replace('"consumed_samples": 16', '"consumed_samples": 17'))
    assert catalog.incomplete_reason(str(tmp_path / "iter_0000002")) == \
        "metadata.json fails its sha256 checksum (its bytes changed after it was written)"
    assert load(tmp_path)[0] == LoadResult(1, 8)


def _reseal(path, change) -> None:
    """Edit metadata.json and give it a matching checksum, as a hand edit that knows the format would."""
    meta = catalog.read_metadata(str(path.parent))
    change(meta)
    integrity.write_json(str(path), catalog.seal({k: v for k, v in meta.items() if k != "metadata_sha256"}))


def _drop(key):
    return lambda meta: meta.pop(key)


def _unlisted_shard(meta):
    entry = next(e for k, e in meta["tensors"].items() if k.startswith("model:"))
    entry["shards"]["0"] = "model_tp01_pp000.safetensors"


def _outside_file(meta):
    meta["files"]["../" + FILES[0]] = meta["files"].pop(FILES[0])


_ALTERATIONS = {
    "edited value": lambda p: p.write_text(p.read_text().replace('"consumed_samples": 16', '"consumed_samples": 17')),
    "checksum removed": lambda p: _reseal(p, lambda m: None) or p.write_text(
        p.read_text().replace('"metadata_sha256"', '"metadata_sha257"')),
    "cut short": lambda p: p.write_bytes(p.read_bytes()[:200]),
    "future format": lambda p: _reseal(p, lambda m: m.update(format_version=9)),
    "no tensor index": lambda p: _reseal(p, _drop("tensors")),
    "no file list": lambda p: _reseal(p, _drop("files")),
    "samples as text": lambda p: _reseal(p, lambda m: m.update(consumed_samples="16")),
    "shard not listed": lambda p: _reseal(p, _unlisted_shard),
    "file outside the checkpoint": lambda p: _reseal(p, _outside_file),
}


@pytest.mark.parametrize("alteration", list(_ALTERATIONS))
def test_verify_checkpoint_rejects_every_metadata_the_loader_rejects(tmp_path, capsys, warnings, alteration):
    save(tmp_path, 1)
    save(tmp_path, 2)
    _ALTERATIONS[alteration](tmp_path / "iter_0000002" / cio.METADATA)
    assert load(tmp_path)[0] == LoadResult(1, 8), "the loader used the altered checkpoint"
    text = " ".join(r.getMessage() for r in warnings)
    assert "iter_0000002 (metadata.json " in text, text
    capsys.readouterr()
    assert verify_checkpoint.main([str(tmp_path / "iter_0000002")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{tmp_path / 'iter_0000002'}: metadata.json "), lines
    assert verify_checkpoint.main([str(tmp_path / "iter_0000001")]) == 0
