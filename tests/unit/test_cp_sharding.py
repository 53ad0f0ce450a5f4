"""Causal load balance of context parallelism (core/context_parallel/sharding.py): chunks, round trips,
global positions, batch sharding and the errors a user can cause."""
import pytest
import torch

from llamapipe.core.context_parallel import chunk_ids, local_positions, shard_batch, shard_sequence, unshard_sequence
from llamapipe.training.flag_names import worded_as_flags


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_every_chunk_held_once_and_work_balanced(cp_size):
    """The 2cp chunks are each held by one rank, and every rank's causal work (sum of keys its queries see)
    is the same."""
    held = sorted(c for r in range(cp_size) for c in chunk_ids(cp_size, r))
    assert held == list(range(2 * cp_size))
    work = {sum(c + 1 for c in chunk_ids(cp_size, r)) for r in range(cp_size)}
    assert work == {2 * cp_size + 1}
    assert chunk_ids(4, 1) == (1, 6)


@pytest.mark.parametrize("cp_size, dim", [(2, 0), (2, 1), (4, 1), (4, 2)])
def test_round_trip(cp_size, dim):
    """unshard(shard(t) for every rank) is t, and each shard is head chunk then tail chunk."""
    t = torch.arange(2 * 3 * 16 * 5).reshape(2, 3, 16, 5).movedim(2, dim)
    parts = [shard_sequence(t, dim, cp_size, r) for r in range(cp_size)]
    assert all(p.shape[dim] == 16 // cp_size for p in parts)
    torch.testing.assert_close(unshard_sequence(parts, dim), t, rtol=0, atol=0)
    chunk = 16 // (2 * cp_size)
    torch.testing.assert_close(parts[0].narrow(dim, chunk, chunk), t.narrow(dim, 16 - chunk, chunk), rtol=0, atol=0)


def test_local_positions():
    """Global positions of the local tokens: rank 1 of 2 at s 8 holds chunks 1 and 2."""
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert local_positions(6, 1, 0).tolist() == list(range(6))
    assert local_positions(8, 2, 0).dtype == torch.long


def test_shard_batch():
    """tokens/labels/loss_mask cut along dim 1, position_ids added (b, s_local) with global positions;
    other keys kept, the input untouched; cp 1 returns the batch itself."""
    tokens = torch.arange(16).reshape(2, 8)
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": torch.ones(2, 8), "extra": "kept"}
    assert shard_batch(batch, 1, 0) is batch
    out = shard_batch(batch, 2, 0)
    assert out is not batch and set(out) == set(batch) | {"position_ids"}
    assert out["tokens"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert out["labels"].tolist() == [[100, 101, 106, 107], [108, 109, 114, 115]]
    assert out["loss_mask"].shape == (2, 4) and out["extra"] == "kept"
    assert out["position_ids"].tolist() == [[0, 1, 6, 7]] * 2 and out["position_ids"].dtype == torch.long
    assert batch["tokens"].shape == (2, 8) and "position_ids" not in batch


def test_shard_batch_keeps_given_positions_and_missing_keys():
    """position_ids already in the batch (e.g. documents reset) are sharded, not recomputed; a pipeline
    stage's batch without tokens (labels only) shards too."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    out = shard_batch({"labels": torch.zeros(1, 8, dtype=torch.long), "position_ids": positions,
                       "tokens": None}, 2, 1)
    assert out["position_ids"].tolist() == [[2, 0, 1, 2]] and out["tokens"] is None
    assert out["labels"].shape == (1, 4)


def test_errors_name_the_flags():
    with pytest.raises(ValueError, match=r"--seq-length 12 is not divisible by 2 x --context-parallel-size \(8\)"), \
            worded_as_flags():
        shard_batch({"tokens": torch.zeros(1, 12)}, 4, 0)
    with pytest.raises(ValueError, match="--context-parallel-size"), worded_as_flags():
        local_positions(10, 4, 0)
    with pytest.raises(ValueError, match="--seq-length 6"), worded_as_flags():
        shard_sequence(torch.zeros(6), 0, 2, 1)


def test_rope_tables_do_not_depend_on_the_positions_layout():
    """shard_batch's contiguous (b, s/cp) positions and the model's expanded default give RoPE tables of the
    same values, shape and strides: a layer compiled on one (the --compile warm-up) is not recompiled on the
    other (dynamo guards on strides)."""
    from llamapipe.model.layers import RotaryEmbedding
    rotary = RotaryEmbedding(8, 32, 10000.0)
    given = shard_batch({"tokens": torch.zeros(3, 16)}, 2, 1)["position_ids"]
    default = local_positions(16, 2, 1).expand(3, -1)
    for a, b in zip(rotary(8, given, torch.float32), rotary(8, default, torch.float32)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert a.shape == (8, 3, 1, 8) and a.stride() == b.stride()
