"""DP-sharded resumable sampling: resume at consumed_samples = k equals the uninterrupted run from k on,
and the union over DP ranks of every global batch is the dp=1 global batch (mock and indexed data)."""
import pytest
import torch

from llamapipe.core.config import DataConfig, TrainingConfig
from llamapipe.data.sampler import EvalSampler, PretrainingSampler, build_data_iterators
from tests.harness import run_distributed
from tests.unit.test_data_gpt_dataset import write_docs

MBS, GBS, SEQ, ITERS = 2, 8, 16, 6


def _configs(tmp_path, mock, split="90,10,0", eval_iters=2):
    data = DataConfig(data_path=() if mock else (write_docs(tmp_path / "d", 80)[0],), split=split, mock_data=mock,
                      data_cache_path=str(tmp_path / "cache"))
    training = TrainingConfig(micro_batch_size=MBS, global_batch_size=GBS, seq_length=SEQ, train_iters=ITERS,
                              eval_iters=eval_iters, seed=11)
    return data, training


def _global_batches(it, dp_size, iters):
    """iters global batches of this rank's microbatches, as lists of token rows."""
    num_mb = GBS // (MBS * dp_size)
    out = []
    for _ in range(iters):
        rows = []
        for _ in range(num_mb):
            mb = next(it)
            assert mb["tokens"].shape == (MBS, SEQ) and mb["tokens"].dtype == torch.int64
            assert mb["loss_mask"].dtype == torch.float32
            torch.testing.assert_close(mb["labels"][:, :-1], mb["tokens"][:, 1:], rtol=0, atol=0)
            rows += mb["tokens"].tolist()
        out.append(rows)
    return out


def test_sampler_slices_and_resume():
    # microbatch j of DP rank r in global batch b: b*gbs + j*mbs*dp + r*mbs + [0, mbs)
    assert list(PretrainingSampler(16, 0, 2, 1, 2)) == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert list(PretrainingSampler(16, 8, 2, 0, 2)) == [[8, 9], [12, 13]]
    for dp in (1, 2):
        for r in range(dp):
            full = list(PretrainingSampler(48, 0, 2, r, dp))
            assert list(PretrainingSampler(48, 24, 2, r, dp)) == full[24 // (2 * dp):]
    with pytest.raises(ValueError, match="consumed samples 3 is not a multiple"):
        PretrainingSampler(48, 3, 2, 0, 2)
    cyc = iter(EvalSampler(8, 0, 2, 0, 2))
    assert [next(cyc) for _ in range(4)] == [[0, 1], [4, 5], [0, 1], [4, 5]]


@pytest.mark.parametrize("mock", [True, False])
def test_iterators_resume_and_dp_union(tmp_path, mock):
    data, training = _configs(tmp_path, mock)
    ref = _global_batches(build_data_iterators(data, training, dp_rank=0, dp_size=1, vocab_size=1000)[0], 1, ITERS)
    assert len({tuple(map(tuple, b)) for b in ref}) == ITERS
    for dp in (1, 2):
        for k in (0, 2):   # resume after k global batches
            per_rank = [_global_batches(build_data_iterators(data, training, dp_rank=r, dp_size=dp, vocab_size=1000,
                                                             consumed_samples=k * GBS)[0], dp, ITERS - k)
                        for r in range(dp)]
            for b in range(ITERS - k):
                union = sorted(row for rank_batches in per_rank for row in rank_batches[b])
                assert union == sorted(ref[k + b]), (dp, k, b)
            if dp == 2:   # ranks see disjoint microbatches (different rows)
                assert per_rank[0][0] != per_rank[1][0]


def test_eval_iterators_repeat_and_respect_split(tmp_path):
    data, training = _configs(tmp_path, mock=False)
    train, valid, test = build_data_iterators(data, training, dp_rank=0, dp_size=1, vocab_size=1000)
    assert test is None   # split share 0
    first, second = _global_batches(valid, 1, 2), _global_batches(valid, 1, 2)
    assert first == second   # every evaluation scores the same eval_iters global batches
    assert build_data_iterators(data, training, dp_rank=0, dp_size=1, vocab_size=1000, needs_data=False) == \
        (None, None, None)


def _distributed_body(rank, world_size, prefix, cache):
    data = DataConfig(data_path=(prefix,), split="90,10,0", data_cache_path=cache)
    training = TrainingConfig(micro_batch_size=MBS, global_batch_size=GBS, seq_length=SEQ, train_iters=ITERS,
                              eval_iters=1, seed=11)
    # a middle pipeline stage (rank 1 here) joins only the barrier
    first = build_data_iterators(data, training, dp_rank=rank, dp_size=2, vocab_size=1000, needs_data=rank == 0)
    assert (first[0] is not None) == (rank == 0)
    train = build_data_iterators(data, training, dp_rank=rank, dp_size=2, vocab_size=1000)[0]
    return _global_batches(train, 2, ITERS)


@pytest.mark.slow
def test_distributed_build_once_and_dp_union(tmp_path):
    prefix, _ = write_docs(tmp_path / "d", 80)
    cache = str(tmp_path / "cache")
    per_rank = run_distributed(_distributed_body, 2, prefix, cache, timeout=120)
    data, training = DataConfig(data_path=(prefix,), split="90,10,0", data_cache_path=cache), TrainingConfig(
        micro_batch_size=MBS, global_batch_size=GBS, seq_length=SEQ, train_iters=ITERS, eval_iters=1, seed=11)
    ref = _global_batches(build_data_iterators(data, training, dp_rank=0, dp_size=1, vocab_size=1000)[0], 1, ITERS)
    for b in range(ITERS):
        assert sorted(per_rank[0][b] + per_rank[1][b]) == sorted(ref[b])
    # train + valid indices and the data file's max token id, built once, no temp files
    assert len(list((tmp_path / "cache").iterdir())) == 7


@pytest.mark.parametrize("mock", [True, False])
def test_first_and_last_stage_chunks_share_one_dataset(tmp_path, monkeypatch, mock):
    """Under the V placement one rank holds the first and the last stage: build_iterators builds the datasets
    once, and both chunks read the same microbatches as one build_data_iterators call, also when the first
    stage's forwards run ahead of the last stage's."""
    import llamapipe.data.sampler as sampler
    from llamapipe.training.config import Config
    from llamapipe.core.parallel_state import ParallelState
    from llamapipe.training.setup import build_iterators
    data, training = _configs(tmp_path, mock)
    builds = []
    for name in ("MockGPTDataset", "build_gpt_datasets"):
        real = getattr(sampler, name)
        monkeypatch.setattr(sampler, name, lambda *a, _real=real, **k: builds.append(1) or _real(*a, **k))
    consumed = 2 * GBS
    ref_train, ref_valid, _ = build_data_iterators(data, training, dp_rank=0, dp_size=1, vocab_size=1000,
                                                   consumed_samples=consumed)
    one_build = len(builds)
    config = Config(data=data, training=training)
    train, valid = build_iterators(config, config.model.replace(vocab_size=1000), ParallelState(),
                                   [(True, False), (False, True)], consumed)
    assert len(builds) == 2 * one_build   # the reference call above plus one build for both chunks
    num_mb, lead = (ITERS - 2) * GBS // MBS, 3
    first = [next(train[0]) for _ in range(lead)]
    last = []
    for _ in range(num_mb - lead):
        first.append(next(train[0]))
        last.append(next(train[1]))
    last += [next(train[1]) for _ in range(lead)]
    with pytest.raises(StopIteration):
        next(train[0])
    ref_train = list(ref_train)
    for name in ("tokens", "labels", "loss_mask"):
        expected = torch.stack([mb[name] for mb in ref_train])
        for got in (first, last):   # both chunks see the reference microbatches in order
            torch.testing.assert_close(torch.stack([mb[name] for mb in got]), expected, rtol=0, atol=0)
    for _ in range(2):   # two evaluations of eval_iters global batches each
        assert _global_batches(valid[0], 1, 2) == _global_batches(valid[1], 1, 2) == _global_batches(ref_valid, 1, 2)


def test_rank_without_data_chunks_still_evaluates(tmp_path):
    """A rank that holds only middle stages (rank 1 of pp 2 under the V placement) reads no data but must join
    every evaluation schedule, so its validation list exists (all None) whenever --eval-iters > 0."""
    from llamapipe.training.config import Config
    from llamapipe.core.parallel_state import ParallelState
    from llamapipe.training.setup import build_iterators
    for eval_iters in (2, 0):
        data, training = _configs(tmp_path, mock=True, eval_iters=eval_iters)
        config = Config(data=data, training=training)
        train, valid = build_iterators(config, config.model.replace(vocab_size=1000), ParallelState(),
                                       [(False, False), (False, False)], 0)
        assert train == [None, None]
        assert valid == ([None, None] if eval_iters else None)
