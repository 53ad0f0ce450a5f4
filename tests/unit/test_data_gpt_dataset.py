"""GPT dataset indices against a brute-force token stream, split, cache, blending weights, seeds, mock data."""
import os

import numpy as np
import pytest
import torch

from llamapipe.data.gpt_dataset import (BlendedDataset, GPTDataset, MockGPTDataset, blending_index, build_gpt_datasets,
                              build_indices, split_ranges)
from llamapipe.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter


def write_docs(prefix, num_docs, seed=0, base=0, max_len=40):
    """Random documents; token values base + small ints so datasets can be told apart."""
    rng = np.random.default_rng(seed)
    w = IndexedDatasetWriter(str(prefix))
    docs = [base + rng.integers(0, 1000, size=int(rng.integers(1, max_len))) for _ in range(num_docs)]
    for d in docs:
        w.add_document(d)
    w.finalize()
    return str(prefix), docs


def test_windows_match_brute_force_stream(tmp_path):
    prefix, docs = write_docs(tmp_path / "d", 30)
    ds = GPTDataset(IndexedDataset(prefix), (5, 25), num_samples=50, seq_length=16, seed=7, name="train",
                    cache_dir=str(tmp_path / "cache"))
    # reference: the documents in doc_idx order as one stream; window i = stream[i*s : i*s + s + 1]
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    assert set(np.asarray(ds.doc_idx)) == set(range(5, 25))
    assert len(ds) >= 50 and sorted(ds.shuffle_idx) == list(range(len(ds)))
    for i in range(len(ds)):
        j = int(ds.shuffle_idx[i])
        sample = ds[i]
        np.testing.assert_array_equal(sample["tokens"].numpy(), stream[j * 16:j * 16 + 16])
        np.testing.assert_array_equal(sample["labels"].numpy(), stream[j * 16 + 1:j * 16 + 17])
    assert sample["tokens"].dtype == sample["labels"].dtype == torch.int64
    assert sample["loss_mask"].dtype == torch.float32 and float(sample["loss_mask"].sum()) == 16


def test_epochs_repeat_documents_when_more_samples_are_needed():
    lengths = np.array([10, 10, 10])
    doc_idx, sample_idx, shuffle_idx = build_indices(lengths, np.arange(3), num_samples=20, seq_length=4, seed=1)
    assert len(doc_idx) == 9 and np.bincount(doc_idx).tolist() == [3, 3, 3]   # 3 epochs: (90 - 1) // 4 = 22
    assert len(shuffle_idx) == 22 and len(sample_idx) == 23


def test_split_ranges_follow_megatron():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("98,2,0", 10) == [(0, 10), (10, 10), (10, 10)]
    # current Megatron (BlendedMegatronDatasetBuilder) rounds the cumulative fractions: 0, 3.33 -> 3, 6.67 -> 7, 10
    # (legacy Megatron rounded each share and shifted the bounds: 0, 4, 7, 10)
    assert split_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]


def test_cache_is_reused_and_keyed_by_settings(tmp_path):
    prefix, _ = write_docs(tmp_path / "d", 20)
    cache = str(tmp_path / "cache")
    a = GPTDataset(IndexedDataset(prefix), (0, 20), 30, 8, 1, "train", cache)
    files = sorted(os.listdir(cache))
    assert len(files) == 3
    b = GPTDataset(IndexedDataset(prefix), (0, 20), 30, 8, 1, "train", cache)
    assert sorted(os.listdir(cache)) == files and isinstance(b.shuffle_idx, np.memmap)
    np.testing.assert_array_equal(a.shuffle_idx, b.shuffle_idx)
    GPTDataset(IndexedDataset(prefix), (0, 20), 30, 8, 2, "train", cache)   # another seed: new files
    assert len(os.listdir(cache)) == 6


@pytest.mark.parametrize("damage, says", [
    ("shuffle_idx out of range", "holds sample numbers from "),
    ("shuffle_idx truncated", "cannot be read ("),
    ("sample_idx windows", "holds windows of other than --seq-length 8 tokens"),
    ("doc_idx of another split", "names documents outside this split's 0:20"),
])
def test_a_damaged_index_cache_is_named_with_the_fix(tmp_path, damage, says):
    """Issue 51: a shuffle index pointing past the samples gave an IndexError from a DataLoader worker, a cut-short
    one numpy's "mmap length is greater than file size" naming no file. Now: one line naming the file, and the fix."""
    prefix, _ = write_docs(tmp_path / "d", 20)
    cache = tmp_path / "cache"
    GPTDataset(IndexedDataset(prefix), (0, 20), 30, 8, 1, "train", str(cache))
    name = damage.split()[0]
    (path,) = cache.glob(f"*-{name}.npy")
    array = np.load(path)
    if damage == "shuffle_idx truncated":
        path.write_bytes(path.read_bytes()[:-16])
    else:
        array = array.copy()
        if name == "shuffle_idx":
            array[0] = 10 ** 6
        elif name == "sample_idx":
            array[1, 1] += 1 if array[1, 1] + 1 < 2 else -1
        else:
            array[0] = 25
        np.save(path, array)
    with pytest.raises(ValueError) as info:
        GPTDataset(IndexedDataset(prefix), (0, 20), 30, 8, 1, "train", str(cache))
    message = str(info.value)
    assert message.startswith(f"data index cache {path} {says}") and "\n" not in message, message
    assert message.endswith("; delete it (the three " + path.name.rsplit("-", 1)[0] + "-*.npy files) and it is "
                            "rebuilt from the data"), message


def test_same_seed_same_samples_other_seed_other_order(tmp_path):
    prefix, _ = write_docs(tmp_path / "d", 40)

    def samples(seed, cache):
        ds = build_gpt_datasets([prefix], "90,10,0", [40, 0, 0], 8, seed, str(tmp_path / cache))[0]
        return [ds[i]["tokens"].tolist() for i in range(40)]
    assert samples(3, "c1") == samples(3, "c2")
    assert samples(3, "c1") != samples(4, "c1")


def test_blending_realises_weights(tmp_path):
    ids, ranks = blending_index([0.3, 0.7], 1000)
    counts = np.bincount(ids)
    assert abs(counts[0] / 1000 - 0.3) < 0.01 and abs(counts[1] / 1000 - 0.7) < 0.01
    for d in (0, 1):   # each dataset's samples are taken in order 0, 1, 2, ...
        assert ranks[ids == d].tolist() == list(range(counts[d]))
    prefix_a, _ = write_docs(tmp_path / "a", 50, seed=1, base=0)
    prefix_b, _ = write_docs(tmp_path / "b", 50, seed=2, base=30000)
    train = build_gpt_datasets(["1", prefix_a, "3", prefix_b], "1,0,0", [400, 0, 0], 8, 5,
                               str(tmp_path / "cache"))[0]
    assert isinstance(train, BlendedDataset) and len(train) == 400
    from_b = sum(int(train[i]["tokens"][0] >= 30000) for i in range(400))
    assert abs(from_b / 400 - 0.75) < 0.01


def test_empty_split_is_a_clear_error(tmp_path):
    prefix, _ = write_docs(tmp_path / "d", 10)
    with pytest.raises(ValueError, match="the valid split of .* is empty"):
        build_gpt_datasets([prefix], "100,0,0", [10, 10, 0], 8, 1, str(tmp_path / "c"))


def test_mock_data_is_deterministic_and_learnable():
    ds = MockGPTDataset(10, 32, vocab_size=100, seed=1)
    t = ds.tokens(3)
    assert t.max() < 100 and len(t) == 33
    np.testing.assert_array_equal(t, MockGPTDataset(10, 32, 100, 1).tokens(3))
    steps = np.diff(t) % 100
    assert len(set(steps.tolist())) == 1 and 1 <= steps[0] <= 4   # constant stride: predictable
    assert not np.array_equal(ds.tokens(3), MockGPTDataset(10, 32, 100, 2).tokens(3))
