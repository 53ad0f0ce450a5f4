"""The run-time plumbing of context parallelism without processes: a model chunk takes the whole sequence and
keeps a CP rank's two chunks of it and their global positions, `forward_step` hands chunks whole sequences and
cuts the loss mask (and the vocabulary-parallel targets) as the chunk cuts its losses, the vocabulary-parallel
embedding prepass looks up the chunk's tokens, and a checkpoint's layout recorded before the cp axis existed is
the same layout as cp 1's."""
import torch

from llamapipe.core.context_parallel import SequenceShard, shard_sequence
from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.tensor_parallel.vocab_pipeline import EmbeddingPrepass, PipelineVocabEmbedding
from llamapipe.model.llama import LlamaConfig, LlamaModel
from llamapipe.training.checkpointing.selection import same_layout
from llamapipe.training.setup import forward_step


class Recorder(torch.nn.Module):
    """A chunk that embeds and computes the loss, recording what the forward step gives it; its per-token
    losses are its rank's share of the labels."""

    def __init__(self, cp_size: int, cp_rank: int, vocab_parallel: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.pre_process = self.post_process = True
        self.vocab_parallel, self.calls = vocab_parallel, []
        self.sequence_shard = SequenceShard(cp_size, cp_rank)

    def forward(self, input_ids, labels, **kw):
        self.calls.append((input_ids, labels, kw))
        return self.sequence_shard(labels).float()


def batch(b: int = 2, s: int = 16) -> dict:
    tokens = torch.arange(b * s).reshape(b, s)
    mask = torch.ones(b, s)
    mask[1, 2] = 0.0
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": mask}


def test_a_chunk_keeps_each_cp_ranks_chunks_and_their_global_positions():
    """A chunk with no layers (so no CP group is used) at cp 4: RoPE gets the global positions of the rank's
    two chunks, and its per-token losses are the single-rank model's at those tokens."""
    config = LlamaConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                         num_query_groups=2, vocab_size=64, max_position_embeddings=32)
    whole = LlamaModel(config, layer_range=(0, 0))
    expected = whole(batch()["tokens"] % 64, labels=batch()["labels"] % 64)
    for rank in range(4):
        ps = ParallelState(rank=rank, world_size=4, cp_size=4, cp_rank=rank, cp_group=object())
        model = LlamaModel(config, ps, layer_range=(0, 0))
        seen = []
        model.rotary.register_forward_hook(lambda module, args, out: seen.append(args[1]))
        losses = model(batch()["tokens"] % 64, labels=batch()["labels"] % 64)
        head, tail = rank * 2, (7 - rank) * 2          # chunks of 2 tokens: rank r holds chunks r and 7 - r
        want = torch.tensor([head, head + 1, tail, tail + 1])
        torch.testing.assert_close(seen[0], want.expand(2, -1), rtol=0, atol=0)
        torch.testing.assert_close(losses, expected[:, want], rtol=0, atol=0)


def test_forward_step_gives_whole_sequences_and_cuts_the_loss_mask_as_the_chunk_cuts():
    for rank in range(4):
        model = Recorder(cp_size=4, cp_rank=rank)
        losses, loss_func = forward_step(iter([batch()]), model)
        tokens, labels, kw = model.calls[0]
        torch.testing.assert_close(tokens, batch()["tokens"], rtol=0, atol=0)
        torch.testing.assert_close(labels, batch()["labels"], rtol=0, atol=0)
        assert kw == {}
        mask = shard_sequence(batch()["loss_mask"], 1, 4, rank)
        loss_sum, num_tokens, _ = loss_func(losses)
        assert num_tokens == mask.sum() and loss_sum == (losses * mask).sum()


def test_the_vocab_parallel_loss_targets_are_cut_and_the_prepass_embeds_the_chunks_tokens():
    model = Recorder(cp_size=2, cp_rank=1, vocab_parallel=True)
    _, targets = forward_step(iter([batch()]), model)
    torch.testing.assert_close(targets.labels, shard_sequence(batch()["labels"], 1, 2, 1), rtol=0, atol=0)
    torch.testing.assert_close(targets.loss_mask, shard_sequence(batch()["loss_mask"], 1, 2, 1), rtol=0, atol=0)
    shard = PipelineVocabEmbedding(64, 4, None, 0, 1, sequence_shard=SequenceShard(2, 0))
    torch.nn.init.normal_(shard.weight)
    partial, _ = forward_step(iter([batch()]), EmbeddingPrepass(shard))
    local = shard_sequence(batch()["tokens"], 1, 2, 0)
    torch.testing.assert_close(partial, shard.weight[local.t()], rtol=0, atol=0)   # (s/cp, b, h)


def test_a_layout_recorded_before_cp_is_the_same_layout_at_cp_1():
    now = {"world_size": 2, "tp": 1, "cp": 1, "dp": 2, "pp": 1, "vpp": 1, "order": "tp-cp-dp-pp"}
    old = {"world_size": 2, "tp": 1, "dp": 2, "pp": 1, "vpp": 1, "order": "tp-dp-pp"}
    assert same_layout(old, now) and same_layout(now, now)
    assert not same_layout(old, {**now, "cp": 2, "dp": 1})
    assert not same_layout({**old, "order": "dp-tp-pp"}, now)
    assert not same_layout(None, now)
