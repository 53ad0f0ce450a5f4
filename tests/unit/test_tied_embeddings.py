"""Tied embeddings split over two chunks, in one process (the V placements' case: both ends on one rank): the last
chunk's output weight is a copy of the first chunk's embedding, initialised as the embedding (bit for bit); after
`finalize_model_grads` both copies hold the whole model's tied gradient (the one-chunk model's, rtol 1e-6), the
norm counts the matrix once, a checkpoint stores the embedding alone and loads it into both copies, and a save
refuses copies that differ. The tie across ranks (all-reduce and all-gather over the embedding group) is
tests/multiproc/test_tied_embeddings.py's; through the CLI under every schedule tests/e2e/test_tied_embeddings_cli.py."""
import pytest
import torch

from llamapipe.core.distributed.grad_reduce import finalize_model_grads, tied_copies_equal
from llamapipe.core.optimizer.clip_grads import counts_for_norm
from llamapipe.core.parallel_state import ParallelState
from llamapipe.model.llama import LlamaConfig, LlamaModel
from llamapipe.training.checkpointing.resharding import named_tensors
from llamapipe.training.checkpointing.tie_check import check_tie
from llamapipe.training.checkpointing.writer import CheckpointSaveError

CONFIG = LlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     vocab_size=100, tie_word_embeddings=True)


def _chunks() -> tuple[LlamaModel, LlamaModel]:
    first = LlamaModel(CONFIG, layer_range=(0, 1), pre_process=True, post_process=False, seed=3)
    last = LlamaModel(CONFIG, layer_range=(1, 2), pre_process=False, post_process=True, seed=3)
    return first, last


def test_the_copy_starts_as_the_embedding_and_is_marked():
    first, last = _chunks()
    whole = LlamaModel(CONFIG, seed=3)
    assert not hasattr(whole, "output"), "one chunk with both ends uses the embedding itself"
    assert torch.equal(first.embedding.weight, last.output.weight)
    assert torch.equal(last.output.weight, whole.embedding.weight)
    assert torch.count_nonzero(last.output.weight[CONFIG.vocab_size:]) == 0      # padding rows start at zero
    assert not counts_for_norm(last.output.weight, 0) and counts_for_norm(first.embedding.weight, 0)
    assert tied_copies_equal([first, last], ParallelState()) is True
    assert tied_copies_equal([whole], ParallelState()) is None


def test_both_copies_get_the_whole_models_gradient():
    """Two chunks run as a pipeline would (the hidden state handed over): after the reduction each copy's gradient
    is the tied gradient of the one-chunk model, embedding lookup plus output layer."""
    first, last = _chunks()
    whole = LlamaModel(CONFIG, seed=3)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    whole(ids, labels=ids).sum().backward()
    hidden = first(ids)
    handed = hidden.detach().requires_grad_(True)
    last.set_input_tensor(handed)
    last(labels=ids).sum().backward()
    hidden.backward(handed.grad)
    assert not torch.allclose(first.embedding.weight.grad, last.output.weight.grad)   # before: apart
    finalize_model_grads([first, last], ParallelState(), None, global_tokens=1.0)
    want = whole.embedding.weight.grad
    assert torch.equal(first.embedding.weight.grad, last.output.weight.grad)
    torch.testing.assert_close(last.output.weight.grad, want, rtol=1e-6, atol=1e-9)


def test_a_checkpoint_holds_the_embedding_once_and_loads_both_copies():
    first, last = _chunks()
    assert set(named_tensors([first, last], copies=False)) >= {"embedding.weight"}
    assert "output.weight" not in named_tensors([first, last], copies=False)
    assert "output.weight" in named_tensors([first, last])
    with torch.no_grad():
        first.embedding.weight.add_(1.0)
    state = {name: t.detach().clone() for name, t in named_tensors([first, last], copies=False).items()}
    last.load_logical_state_dict(state, strict=True)
    assert torch.equal(last.output.weight, first.embedding.weight)


def test_a_save_refuses_copies_that_differ(llamapipe_log):
    first, last = _chunks()
    check_tie([first, last], ParallelState(), 4)
    assert "iteration 4: the tied embedding's copies on the first and the last pipeline stage are equal bit for " \
           "bit" in llamapipe_log
    with torch.no_grad():
        last.output.weight[0, 0] += 1e-7
    with pytest.raises(CheckpointSaveError, match="iteration 5: the tied embedding's copies .* differ"):
        check_tie([first, last], ParallelState(), 5)
