"""PipelineVocabOutput (vocabulary parallelism, arXiv 2411.05288) against a plain full-vocabulary cross entropy:
the shards of P pipeline ranks, run in one process, give the same per-token loss, input gradient (the sum of the
partials) and weight gradient (the shards' concatenation) as torch's cross entropy on the whole output layer,
in fp32 within rel 1e-5, with padding rows, a shard that is padding only, and labels in every real shard."""
import pytest
import torch
import torch.nn.functional as F

from llamapipe.core.tensor_parallel.layers import shard_logical_tensor
from llamapipe.core.tensor_parallel.vocab_pipeline import PipelineVocabOutput

TOL = dict(rtol=1e-5, atol=1e-6)


def _shards(vocab: int, padded: int, hidden: int, pp: int, weight: torch.Tensor) -> list[PipelineVocabOutput]:
    shards = []
    for pp_rank in range(pp):
        shard = PipelineVocabOutput(padded, hidden, vocab, None, pp_rank, pp)
        with torch.no_grad():
            shard.weight.copy_(shard_logical_tensor(weight, shard.weight, shard.weight.vocab_shard, pp))
        shards.append(shard)
    return shards


def _run(shards, x: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
    """S on every shard, the statistics stacked as the all-gather does, T on every shard."""
    states, stats = zip(*(shard.forward_stats(x, labels) for shard in shards))
    gathered = torch.stack(stats)                                     # (pp, 3, s, b)
    loss = PipelineVocabOutput.combine(gathered)[2]
    partials = [shard.backward(state, gathered, mask) for shard, state in zip(shards, states)]
    return loss, sum(partials)


@pytest.mark.parametrize("vocab,pp,multiple", [(50, 3, 8), (37, 2, 4), (20, 4, 8)],
                         ids=["vocab50-pp3", "vocab37-pp2", "vocab20-pp4-empty-shards"])
def test_losses_and_gradients_match_full_vocabulary_cross_entropy(vocab, pp, multiple):
    torch.manual_seed(0)
    s, b, h = 12, 2, 16
    padded = -(-vocab // (multiple * pp)) * multiple * pp
    weight = torch.randn(vocab, h)
    x = torch.randn(s, b, h)
    rows = padded // pp
    real_shards = [r for r in range(pp) if r * rows < vocab]
    # every real shard holds some label: its first and its last real row
    targets = [v for r in real_shards for v in (r * rows, min((r + 1) * rows, vocab) - 1)]
    labels = torch.tensor(targets * (s * b // len(targets) + 1))[:s * b].view(s, b)
    mask = (torch.rand(s, b) > 0.2).float()
    shards = _shards(vocab, padded, h, pp, weight)
    loss, grad_x = _run(shards, x, labels, mask)

    ref_w, ref_x = weight.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref_loss = F.cross_entropy((ref_x @ ref_w.t()).view(-1, vocab), labels.view(-1), reduction="none").view(s, b)
    (ref_loss * mask).sum().backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    torch.testing.assert_close(grad_x, ref_x.grad, **TOL)
    grad_w = torch.cat([shard.weight.grad for shard in shards])
    torch.testing.assert_close(grad_w[:vocab], ref_w.grad, **TOL)
    assert torch.count_nonzero(grad_w[vocab:]) == 0, "padding rows must get no gradient"
    if pp * rows - vocab >= rows:
        assert not torch.isfinite(shards[-1].forward_stats(x, labels)[1][0]).any(), "an empty shard's max is -inf"


def test_shards_are_tp_major_slices_of_the_logical_weight():
    """tp rank t, pp rank p holds shard t * pp + p: the pp shards of one TP rank are that TP rank's shard."""
    shard = PipelineVocabOutput(64, 4, 60, None, 1, 4)
    assert (shard.vocab_start, shard.weight.vocab_shard, shard.weight.vocab_shards) == (16, 1, 4)
    assert shard.weight.shape == (16, 4) and shard.weight.vocab_padded and shard.weight.tensor_model_parallel


def test_embedding_shards_sum_to_the_full_embedding():
    """The pipeline shards' partial lookups sum to F.embedding of the whole table; each shard's weight
    gradient is its rows of the full gradient (padding rows get none)."""
    from llamapipe.core.tensor_parallel.vocab_pipeline import PipelineVocabEmbedding
    torch.manual_seed(0)
    vocab, pp, h, padded = 37, 3, 8, 48
    weight = torch.randn(vocab, h)
    ids = torch.randint(0, vocab, (2, 10))                            # (b, s)
    grad_out = torch.randn(10, 2, h)                                  # (s, b, h)
    shards = []
    for pp_rank in range(pp):
        shard = PipelineVocabEmbedding(padded, h, None, pp_rank, pp)
        with torch.no_grad():
            shard.weight.copy_(shard_logical_tensor(weight, shard.weight, shard.weight.vocab_shard, pp))
        shards.append(shard)
    total = sum(shard(ids) for shard in shards)
    ref_w = weight.clone().requires_grad_(True)
    ref = F.embedding(ids.t(), ref_w)
    torch.testing.assert_close(total, ref.detach(), rtol=0, atol=0)
    total.backward(grad_out)
    ref.backward(grad_out)
    grad_w = torch.cat([shard.weight.grad for shard in shards])
    torch.testing.assert_close(grad_w[:vocab], ref_w.grad, **TOL)
    assert torch.count_nonzero(grad_w[vocab:]) == 0
