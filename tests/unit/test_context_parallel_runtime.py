"""The run-time plumbing of context parallelism without processes: `forward_step` hands a CP rank its two chunks
of every sequence and their global positions (and the vocabulary-parallel embedding prepass its tokens without
positions), and a checkpoint's layout recorded before the cp axis existed is the same layout as cp 1's."""
import torch

from llamapipe.core.context_parallel import shard_sequence
from llamapipe.core.parallel_state import ParallelState
from llamapipe.training.checkpointing.selection import same_layout
from llamapipe.training.setup import forward_step, step_function


class Recorder(torch.nn.Module):
    """A chunk that embeds and computes the loss, recording what the forward step gives it."""

    def __init__(self, cp_size: int, vocab_parallel: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.pre_process = self.post_process = True
        self.vocab_parallel, self.cp_size, self.calls = vocab_parallel, cp_size, []

    def forward(self, input_ids, labels, **kw):
        self.calls.append((input_ids, labels, kw))
        return torch.zeros((labels if labels is not None else input_ids).shape)


def batch(b: int = 2, s: int = 16) -> dict:
    tokens = torch.arange(b * s).reshape(b, s)
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(b, s)}


def test_forward_step_gives_each_cp_rank_its_chunks_and_their_global_positions():
    for rank in range(4):
        model = Recorder(cp_size=4)
        ps = ParallelState(rank=rank, world_size=4, cp_size=4, cp_rank=rank)
        forward_step(iter([batch()]), model, cp_size=4, cp_rank=rank)
        tokens, labels, kw = model.calls[0]
        head, tail = rank * 2, (7 - rank) * 2          # chunks of 2 tokens: rank r holds chunks r and 7 - r
        want = torch.tensor([head, head + 1, tail, tail + 1])
        torch.testing.assert_close(kw["position_ids"], want.expand(2, -1), rtol=0, atol=0)
        torch.testing.assert_close(tokens, torch.stack([want, want + 16]), rtol=0, atol=0)
        torch.testing.assert_close(labels, tokens + 1, rtol=0, atol=0)
        assert step_function(ps).keywords == {"cp_size": 4, "cp_rank": rank}
    assert step_function(ParallelState()) is forward_step


def test_the_vocab_parallel_loss_targets_are_cut_and_the_prepass_gets_no_positions():
    model = Recorder(cp_size=2, vocab_parallel=True)
    _, targets = forward_step(iter([batch()]), model, cp_size=2, cp_rank=1)
    torch.testing.assert_close(targets.labels, shard_sequence(batch()["labels"], 1, 2, 1), rtol=0, atol=0)
    assert targets.loss_mask.shape == (2, 8)
    prepass = Recorder(cp_size=2)
    del prepass.cp_size                               # the embedding prepass has no cp_size: tokens only
    prepass.post_process = False
    forward_step(iter([batch()]), prepass, cp_size=2, cp_rank=0)
    tokens, labels, kw = prepass.calls[0]
    assert kw == {} and labels is None
    torch.testing.assert_close(tokens, shard_sequence(batch()["tokens"], 1, 2, 0), rtol=0, atol=0)


def test_a_layout_recorded_before_cp_is_the_same_layout_at_cp_1():
    now = {"world_size": 2, "tp": 1, "cp": 1, "dp": 2, "pp": 1, "vpp": 1, "order": "tp-cp-dp-pp"}
    old = {"world_size": 2, "tp": 1, "dp": 2, "pp": 1, "vpp": 1, "order": "tp-dp-pp"}
    assert same_layout(old, now) and same_layout(now, now)
    assert not same_layout(old, {**now, "cp": 2, "dp": 1})
    assert not same_layout({**old, "order": "dp-tp-pp"}, now)
    assert not same_layout(None, now)
