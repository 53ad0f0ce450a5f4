"""core/tensor_parallel primitives: comm ops, parallel linears, vocab-parallel loss, RNG tracker, SP grads."""
import pytest
import torch
import torch.nn.functional as F

from llamapipe.core.tensor_parallel import mappings
from llamapipe.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from llamapipe.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                         allreduce_sequence_parallel_grads, shard_logical_tensor)
from llamapipe.core.tensor_parallel.random import RNGStatesTracker, get_rng_tracker, model_parallel_seed
from tests.harness import run_distributed

VOCAB, PADDED = 37, 40


def _data(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference_mlp(x: torch.Tensor, w_col: torch.Tensor, w_row: torch.Tensor):
    x = x.clone().requires_grad_()
    y = (x @ w_col.t()).relu() @ w_row.t()
    y.backward(_data(9, *y.shape))
    return y.detach(), x.grad


def _mlp_case(tp_group, tp_rank: int, sequence_parallel: bool) -> list[str]:
    """Column -> relu -> Row at TP=2 equals the dense computation, output, input grad and weight grads."""
    x_full, w_col, w_row = _data(1, 4, 2, 6), _data(2, 8, 6), _data(3, 6, 8)  # (s, b, h)
    ref_y, ref_dx = _reference_mlp(x_full, w_col, w_row)
    col = ColumnParallelLinear(6, 8, tp_group, sequence_parallel=sequence_parallel)
    row = RowParallelLinear(8, 6, tp_group, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        col.weight.copy_(shard_logical_tensor(w_col, col.weight, tp_rank, 2))
        row.weight.copy_(shard_logical_tensor(w_row, row.weight, tp_rank, 2))
    x = (x_full.chunk(2)[tp_rank] if sequence_parallel else x_full).clone().requires_grad_()
    y = row(col(x).relu())
    grad_y = _data(9, 4, 2, 6)
    y.backward(grad_y.chunk(2)[tp_rank] if sequence_parallel else grad_y)
    expect_y = ref_y.chunk(2)[tp_rank] if sequence_parallel else ref_y
    expect_dx = ref_dx.chunk(2)[tp_rank] if sequence_parallel else ref_dx
    torch.testing.assert_close(y, expect_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, expect_dx, rtol=1e-5, atol=1e-6)
    assert col.weight.grad is not None and row.weight.grad is not None
    return ["mlp"]


def _embedding_and_loss_case(tp_group, tp_rank: int) -> list[str]:
    """Vocab-parallel embedding and cross entropy equal dense F.embedding / F.cross_entropy (padding excluded)."""
    table = torch.cat([_data(4, VOCAB, 5), 50.0 * torch.ones(PADDED - VOCAB, 5)])  # padding rows: huge logits
    ids = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(5))  # (b, s)
    emb = VocabParallelEmbedding(PADDED, 5, tp_group)
    with torch.no_grad():
        emb.weight.copy_(shard_logical_tensor(table, emb.weight, tp_rank, 2))
    torch.testing.assert_close(emb(ids), F.embedding(ids.t(), table), rtol=0, atol=0)

    logits_full = _data(6, 2, 4, PADDED)
    logits_full[..., VOCAB:] = 80.0
    logits_full.requires_grad_()
    shard = logits_full.detach().chunk(2, dim=-1)[tp_rank].clone().requires_grad_()
    losses = vocab_parallel_cross_entropy(shard, ids, tp_group, vocab_size=VOCAB)
    expected = F.cross_entropy(logits_full[..., :VOCAB].reshape(-1, VOCAB), ids.reshape(-1), reduction="none")
    torch.testing.assert_close(losses, expected.view(2, 4), rtol=1e-6, atol=1e-6)
    losses.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(shard.grad, logits_full.grad.chunk(2, dim=-1)[tp_rank], rtol=1e-6, atol=1e-7)
    return ["embedding", "cross_entropy"]


def _mapping_case(tp_group, tp_rank: int) -> list[str]:
    """Sequence gather/reduce-scatter and TP gather/scatter: forward values and backward collectives."""
    x = (_data(7, 4, 3) + tp_rank).requires_grad_()  # differs per rank
    gathered = mappings.gather_from_sequence_parallel_region(x, tp_group)
    torch.testing.assert_close(gathered, torch.cat([_data(7, 4, 3), _data(7, 4, 3) + 1]), rtol=0, atol=0)
    gathered.backward(torch.ones(8, 3))
    torch.testing.assert_close(x.grad, torch.full((4, 3), 2.0), rtol=0, atol=0)  # reduce-scatter of ones
    y = mappings.reduce_scatter_to_sequence_parallel_region(torch.ones(4, 3) * (tp_rank + 1), tp_group)
    torch.testing.assert_close(y, torch.full((2, 3), 3.0), rtol=0, atol=0)
    z = mappings.gather_from_tensor_model_parallel_region(torch.full((2, 1), float(tp_rank)), tp_group)
    torch.testing.assert_close(z, torch.tensor([[0.0, 1.0], [0.0, 1.0]]), rtol=0, atol=0)
    back = mappings.scatter_to_tensor_model_parallel_region(torch.arange(4.0).view(1, 4), tp_group)
    torch.testing.assert_close(back, torch.arange(4.0).view(1, 4).chunk(2, -1)[tp_rank], rtol=0, atol=0)
    return ["mappings"]


def _sp_grads_and_rng_case(tp_group, tp_rank: int) -> list[str]:
    """SP grads are summed over TP; the tracked RNG differs per TP rank while the default stream agrees."""
    norm = torch.nn.Linear(1, 1, bias=False)
    norm.weight.sequence_parallel = True
    norm.weight.grad = torch.full((1, 1), float(tp_rank + 1))
    allreduce_sequence_parallel_grads([norm], tp_group)
    torch.testing.assert_close(norm.weight.grad, torch.full((1, 1), 3.0), rtol=0, atol=0)

    model_parallel_seed(11, tp_rank)
    with get_rng_tracker().fork():
        tracked = torch.rand(4)
    default = torch.rand(4)
    both = [torch.empty(8), torch.empty(8)]
    torch.distributed.all_gather(both, torch.cat([tracked, default]), group=tp_group)
    assert not torch.equal(both[0][:4], both[1][:4]), "model-parallel RNG must differ across TP ranks"
    torch.testing.assert_close(both[0][4:], both[1][4:], rtol=0, atol=0)
    return ["sp_grads", "rng"]


def _worker(rank: int, world_size: int) -> list[str]:
    from llamapipe.core.parallel_state import initialize_model_parallel
    state = initialize_model_parallel(tp=world_size)
    done = []
    for sequence_parallel in (False, True):
        done += _mlp_case(state.tp_group, state.tp_rank, sequence_parallel)
    done += _embedding_and_loss_case(state.tp_group, state.tp_rank)
    done += _mapping_case(state.tp_group, state.tp_rank)
    done += _sp_grads_and_rng_case(state.tp_group, state.tp_rank)
    return done


@pytest.mark.slow
def test_tensor_parallel_primitives_tp2():
    """All TP=2 primitive checks run on both ranks (each raises on mismatch inside its rank)."""
    results = run_distributed(_worker, 2, timeout=180)
    assert results[0] == results[1] == ["mlp", "mlp", "embedding", "cross_entropy", "mappings", "sp_grads", "rng"]


def test_cross_entropy_single_rank_matches_torch():
    """Without a group the loss is plain cross entropy in fp32, also from bf16 logits."""
    logits = _data(1, 3, 5, VOCAB).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    losses = vocab_parallel_cross_entropy(logits, labels, None)
    assert losses.dtype == torch.float32
    expected = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(losses, expected.view(3, 5), rtol=1e-6, atol=1e-6)


def test_rng_tracker_fork_restores_default_stream():
    """fork() draws from the named state and leaves the default stream exactly where it was."""
    tracker = RNGStatesTracker()
    tracker.add("a", 123)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("a"):
        first = torch.rand(3)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)
    with tracker.fork("a"):
        second = torch.rand(3)
    assert not torch.equal(first, second), "the named state must advance"
    with pytest.raises(ValueError):
        tracker.add("b", 123)
    with pytest.raises(ValueError):
        with tracker.fork("missing"):
            pass


def test_cross_entropy_inplace_matches_out_of_place():
    """inplace=True (the model's output head) gives the same losses and logit gradients, padding excluded."""
    labels = torch.randint(0, VOCAB - 3, (3, 5), generator=torch.Generator().manual_seed(3))
    grad = torch.rand(3, 5, generator=torch.Generator().manual_seed(4))
    results = []
    for inplace in (False, True):
        leaf = _data(1, 3, 5, VOCAB).requires_grad_()
        logits = leaf * 1.0  # a temporary, as the head's GEMM output is
        losses = vocab_parallel_cross_entropy(logits, labels, None, vocab_size=VOCAB - 3, inplace=inplace)
        losses.backward(grad)
        results.append((losses, leaf.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
    assert torch.all(results[1][1][..., VOCAB - 3:] == 0)


def _deferred_w_worker(rank: int, world_size: int) -> dict:
    """tp 2 with sequence parallelism: a column-parallel linear's backward under a capturing store keeps the
    sequence shard of its input for W (not the gathered input) and W's gradient equals the immediate one."""
    import torch.distributed as dist
    from llamapipe.core.tensor_parallel.layers import ColumnParallelLinear
    from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, 8, group, sequence_parallel=True)
    x = _data(rank + 1, 6, 2, 16).requires_grad_(True)          # (s/tp, b, h): this rank's sequence shard
    out = {}
    for deferred in (False, True):
        layer.weight.grad = None
        store = WeightGradStore()
        with store.active():
            y = layer(x)
        with store.capture("k") if deferred else store.active():
            y.sum().backward()
        if deferred:
            held = [t for t in store.held_tensors("k") if t.dim() == 3 and t.shape[-1] == 16]
            out["held_rows"] = sorted(t.shape[0] for t in held)
            store.run("k")
        out[deferred] = layer.weight.grad.clone()
    return {"held_rows": out["held_rows"], "equal": bool(torch.equal(out[False], out[True]))}


@pytest.mark.slow
def test_deferred_weight_gradient_keeps_the_sequence_shard():
    for r in run_distributed(_deferred_w_worker, 2, timeout=120):
        assert r["equal"], "the deferred weight gradient differs from the immediate one"
        assert r["held_rows"] == [6], f"W holds inputs of {r['held_rows']} rows; the shard has 6, gathered 12"
