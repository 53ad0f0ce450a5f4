"""GPT pretraining samples: Megatron's document/sample/shuffle indices, train/valid/test split, blending, mock data.

The splits come either from one blend of prefixes whose documents are split by weights (--data-path with
--split, bounds rounded as Megatron's BlendedMegatronDatasetBuilder rounds them), or from one blend per
split, each used whole (--train-data-path / --valid-data-path / --test-data-path).

A split's documents are repeated for as many epochs as needed, shuffled (document index), cut into
consecutive windows of seq_length + 1 tokens that cross document boundaries (sample index; neighbouring
windows share one token, as in Megatron's GPTDataset), and the windows are shuffled (shuffle index).
The three indices depend only on (data file, split range, seq_length, seed, number of samples); they are
cached as .npy files keyed by a hash of all of these and written atomically (rename). Several prefixes
are blended with normalised weights: sample j of dataset d sits at ideal position (j + 0.5) / w_d and the
blend takes positions in order, so after any n samples each dataset has round(w_d * n) +- 1 of them.
With Megatron's --reset-position-ids / --reset-attention-mask / --eod-mask-loss a sample also carries its
documents' boundaries (packed_documents.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Optional, Sequence

import numpy as np
import torch

from llamapipe.core.logger import get_logger
from llamapipe.data.index_cache import load_or_build
from llamapipe.data.indexed_dataset import IndexedDataset, cached_max_token_id, data_file_path
from llamapipe.data.packed_documents import PackedDocuments

SPLIT_NAMES = ("train", "valid", "test")
_INDEX_VERSION = 1   # bump when the index construction changes so stale caches are not reused


def split_ranges(split: str, num_docs: int) -> list[tuple[int, int]]:
    """Megatron's document split: "969,30,1" over num_docs -> [(0, a), (a, b), (b, num_docs)].

    As Megatron: weights normalised in float64, cumulative fractions summed left to right, each bound
    round(fraction * num_docs) with Python's round.
    """
    weights = np.asarray([float(s) for s in split.split(",")], dtype=np.float64)
    assert len(weights) == 3 and weights.sum() > 0, f"bad split {split}"
    cumulative = [0.0]
    for w in (weights / weights.sum()).tolist():
        cumulative.append(cumulative[-1] + w)
    bounds = [int(round(c * float(num_docs))) for c in cumulative]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_indices(sequence_lengths: np.ndarray, doc_ids: np.ndarray, num_samples: int, seq_length: int,
                  seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) giving at least num_samples windows of seq_length + 1 tokens.

    Documents doc_ids (token counts in sequence_lengths) are used. sample_idx[i] = (position in doc_idx,
    token offset) where window i starts; window i ends (inclusive) where window i + 1 starts.
    """
    tokens_per_epoch = int(sequence_lengths[doc_ids].sum())
    assert tokens_per_epoch > 0
    epochs = 1
    while (epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        epochs += 1
    rng = np.random.RandomState(seed)
    doc_idx = np.tile(np.asarray(doc_ids, dtype=np.int64), epochs)
    rng.shuffle(doc_idx)
    lengths = sequence_lengths[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)
    total_samples = (int(ends[-1]) - 1) // seq_length
    starts = np.arange(total_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[position])
    sample_idx = np.stack([position, offset], axis=1)
    shuffle_idx = np.random.RandomState(seed + 1).permutation(total_samples)
    return doc_idx, sample_idx, shuffle_idx


def default_cache_dir(prefix: str) -> str:
    """`<prefix dir>/cache`, or a directory under the system temp dir when that is not writable."""
    cache = os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError:
        pass
    if os.access(cache, os.W_OK):
        return cache
    return os.path.join(tempfile.gettempdir(), "llamapipe_index_cache")


class GPTDataset(torch.utils.data.Dataset):
    """Shuffled seq_length + 1 windows over documents [doc_range) of one indexed dataset."""

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, name: str, cache_dir: Optional[str] = None,
                 documents: Optional[PackedDocuments] = None) -> None:
        self.indexed, self.seq_length, self.name, self.documents = indexed, seq_length, name, documents
        first, last = doc_range
        if last <= first or indexed.sequence_lengths[first:last].sum() == 0:
            raise ValueError(f"the {name} split of {indexed.prefix} is empty (documents {first}:{last}); "
                             "change --split or add data")
        idx_path = indexed.prefix + ".idx"
        key = json.dumps({"idx": os.path.abspath(idx_path), "size": os.path.getsize(idx_path),
                          "mtime": os.path.getmtime(idx_path), "range": [first, last], "n": num_samples,
                          "seq": seq_length, "seed": seed, "version": _INDEX_VERSION}, sort_keys=True)
        digest = hashlib.md5(key.encode()).hexdigest()
        base = os.path.join(cache_dir or default_cache_dir(indexed.prefix),
                            f"{os.path.basename(indexed.prefix)}_{name}_{digest}")
        self.doc_idx, self.sample_idx, self.shuffle_idx = load_or_build(
            base, lambda: build_indices(indexed.sequence_lengths, np.arange(first, last), num_samples, seq_length,
                                        seed), indexed.sequence_lengths, doc_range, num_samples, seq_length)
        assert len(self.shuffle_idx) >= num_samples

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def tokens(self, i: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample i (after shuffling)."""
        j = int(self.shuffle_idx[i])
        (doc_f, off_f), (doc_l, off_l) = self.sample_idx[j], self.sample_idx[j + 1]
        get = self.indexed.get
        if doc_f == doc_l:
            return get(int(self.doc_idx[doc_f]), int(off_f), int(off_l - off_f + 1)).astype(np.int64)
        parts = [get(int(self.doc_idx[doc_f]), int(off_f))]
        parts += [get(int(self.doc_idx[k])) for k in range(doc_f + 1, doc_l)]
        parts.append(get(int(self.doc_idx[doc_l]), 0, int(off_l + 1)))
        out = np.concatenate(parts).astype(np.int64)
        assert len(out) == self.seq_length + 1
        return out

    def __getitem__(self, i: int) -> dict:
        return make_sample(self.tokens(i), self.documents)


def make_sample(window: np.ndarray, documents: Optional[PackedDocuments] = None) -> dict:
    """{tokens, labels, loss_mask} of a window of seq_length + 1 tokens, and its documents' boundaries when
    `documents` says so."""
    tokens = torch.from_numpy(np.ascontiguousarray(window, dtype=np.int64))
    if documents is None:
        return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": torch.ones(len(tokens) - 1)}
    return {"tokens": tokens[:-1], "labels": tokens[1:], **documents.fields(tokens[:-1])}


def blending_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of length num_samples for normalised weights."""
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    keys, ids, ranks = [], [], []
    for d, wd in enumerate(w):
        j = np.arange(int(np.ceil(wd * num_samples)) + 1, dtype=np.int64)
        keys.append((j + 0.5) / wd)
        ids.append(np.full(len(j), d, dtype=np.int64))
        ranks.append(j)
    keys, ids, ranks = np.concatenate(keys), np.concatenate(ids), np.concatenate(ranks)
    order = np.lexsort((ids, keys))[:num_samples]
    return ids[order], ranks[order]


class BlendedDataset(torch.utils.data.Dataset):
    """Samples of several datasets interleaved by `blending_index`."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray) -> None:
        self.datasets, self.dataset_index, self.dataset_sample_index = datasets, dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> dict:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


class MockGPTDataset(torch.utils.data.Dataset):
    """Synthetic but learnable samples: token t = (start + stride * t) mod vocab, seeded per sample.

    The next token follows from the previous two, so a tiny model's loss falls quickly from ln(vocab).
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int,
                 documents: Optional[PackedDocuments] = None) -> None:
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed
        self.documents = documents

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        start, stride = int(rng.integers(self.vocab_size)), int(rng.integers(1, 5))
        return (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size

    def __getitem__(self, i: int) -> dict:
        return make_sample(self.tokens(i), self.documents)


def parse_blend(data_path: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """`A B` -> ([A, B], None); `0.3 A 0.7 B` -> ([A, B], [0.3, 0.7]) (form checked when the arguments are parsed)."""
    try:
        float(data_path[0])
    except ValueError:
        return list(data_path), None
    return list(data_path[1::2]), [float(w) for w in data_path[0::2]]


def build_gpt_datasets(data_path: Sequence[str], split: str, num_samples: Sequence[int], seq_length: int,
                       seed: int, cache_dir: Optional[str] = None, *,
                       per_split_paths: Sequence[Sequence[str]] = ((), (), ()), vocab_size: Optional[int] = None,
                       documents: Optional[PackedDocuments] = None) -> list[Optional[torch.utils.data.Dataset]]:
    """[train, valid, test] datasets with num_samples[i] samples each (None where 0), blended over prefixes.

    `data_path`'s documents are split by `split`; when any of `per_split_paths` (train, valid, test) is
    given, split i is instead the whole of the files of per_split_paths[i]. Unweighted prefixes are
    weighted by their token counts. With `vocab_size`, every file's largest token id must be below it. With
    `documents`, samples carry their documents' boundaries.
    """
    opened: dict[str, IndexedDataset] = {}
    out: list[Optional[torch.utils.data.Dataset]] = []
    for s, (name, n) in enumerate(zip(SPLIT_NAMES, num_samples)):
        if n == 0:
            out.append(None)
            continue
        whole = any(per_split_paths)
        prefixes, weights = parse_blend(per_split_paths[s] if whole else data_path)
        for prefix in prefixes:
            if prefix not in opened:
                opened[prefix] = IndexedDataset(prefix)
                if vocab_size is not None:
                    check_token_ids(opened[prefix], vocab_size, cache_dir or default_cache_dir(prefix))
        indexed = [opened[prefix] for prefix in prefixes]
        ranges = [(0, len(ds)) if whole else split_ranges(split, len(ds))[s] for ds in indexed]
        out.append(_blend(name, prefixes, weights, indexed, ranges, n, seq_length, seed, cache_dir, documents))
    return out


def check_token_ids(indexed: IndexedDataset, vocab_size: int, cache_dir: str) -> None:
    """Refuse a file holding an id the model has no row for: the vocabulary-parallel embedding would silently
    zero it at tp > 1 and index out of range at tp 1."""
    max_id = cached_max_token_id(indexed, cache_dir)
    if max_id >= vocab_size:
        raise ValueError(f"data file {data_file_path(indexed.prefix)} holds token id {max_id}, but the model's "
                         f"vocabulary is {vocab_size} (ids 0..{vocab_size - 1}); train with the tokenizer that "
                         f"preprocessed it (--tokenizer-model), or --vocab-size {max_id + 1} or more")


def _blend(name: str, prefixes: list[str], weights: Optional[list[float]], indexed: list[IndexedDataset],
           ranges: list[tuple[int, int]], n: int, seq_length: int, seed: int, cache_dir: Optional[str],
           documents: Optional[PackedDocuments]) -> torch.utils.data.Dataset:
    """One split's dataset of n samples: the single dataset, or the weighted blend of several."""
    if len(indexed) == 1:
        return GPTDataset(indexed[0], ranges[0], n, seq_length, seed, name, cache_dir, documents)
    if weights is None:
        weights = [float(ds.num_tokens) for ds in indexed]
    dataset_index, sample_index = blending_index(weights, n)
    counts = np.bincount(dataset_index, minlength=len(indexed))
    parts = [GPTDataset(ds, r, max(int(c), 1), seq_length, seed + d, name, cache_dir, documents)
             for d, (ds, r, c) in enumerate(zip(indexed, ranges, counts))]
    realised = ", ".join(f"{p}: {c} ({c / n:.3f} vs weight {w / sum(weights):.3f})"
                         for p, c, w in zip(prefixes, counts, weights))
    get_logger().info("blended %s split, %d samples: %s", name, n, realised)
    return BlendedDataset(parts, dataset_index, sample_index)
