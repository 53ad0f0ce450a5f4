"""Causal load balance of context parallelism (core/context_parallel/sharding.py): chunks, round trips,
global positions, a chunk's sequence shard and the errors a user can cause."""
import pytest
import torch

from llamapipe.core.context_parallel import (SequenceShard, chunk_ids, local_positions, shard_sequence,
                                             unshard_sequence)
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


def test_sequence_shard():
    """A chunk's SequenceShard cuts a (b, s) tensor along dim 1 to its rank's head and tail chunks (a new tensor,
    the input untouched; cp 1 returns the tensor itself, None stays None) and gives the global positions of
    those tokens, (b, s_local) long."""
    tokens = torch.arange(16).reshape(2, 8)
    assert SequenceShard()(tokens) is tokens and SequenceShard(2, 0)(None) is None
    shard = SequenceShard(2, 0)
    assert shard(tokens).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert shard(tokens + 100).tolist() == [[100, 101, 106, 107], [108, 109, 114, 115]]
    assert shard(torch.ones(2, 8)).shape == (2, 4) and tokens.shape == (2, 8)
    positions = shard.positions(4, 2, torch.device("cpu"))
    assert positions.tolist() == [[0, 1, 6, 7]] * 2 and positions.dtype == torch.long


def test_given_positions_are_cut_not_recomputed():
    """Positions of the whole sequence (e.g. documents reset) are cut like the tokens."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert SequenceShard(2, 1)(positions).tolist() == [[2, 0, 1, 2]]


def test_errors_name_the_flags():
    with pytest.raises(ValueError, match=r"--seq-length 12 is not divisible by 2 x --context-parallel-size \(8\)"), \
            worded_as_flags():
        SequenceShard(4, 0)(torch.zeros(1, 12))
    with pytest.raises(ValueError, match="--context-parallel-size"), worded_as_flags():
        local_positions(10, 4, 0)
    with pytest.raises(ValueError, match="--seq-length 6"), worded_as_flags():
        shard_sequence(torch.zeros(6), 0, 2, 1)


def test_rope_tables_do_not_depend_on_the_positions_layout():
    """Given positions cut to (b, s/cp) (contiguous) and the model's expanded default give RoPE tables of the
    same values, shape and strides: a layer compiled on one (the --compile warm-up) is not recompiled on the
    other (dynamo guards on strides)."""
    from llamapipe.model.rotary import RotaryEmbedding
    rotary = RotaryEmbedding(8, 32, 10000.0)
    given = SequenceShard(2, 1)(torch.arange(16).repeat(3, 1))
    default = SequenceShard(2, 1).positions(8, 3, torch.device("cpu"))
    for a, b in zip(rotary(8, given, torch.float32), rotary(8, default, torch.float32)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert a.shape == (8, 3, 1, 8) and a.stride() == b.stride()
