"""Megatron-LM's preprocessed data and ours read by each other's readers identically (issue 49): megatron-core's
own `IndexedDataset` reads a corpus `llamapipe preprocess` wrote, and our reader reads one megatron-core's
`IndexedDatasetBuilder` wrote (tokens, sequence lengths, document boundaries, dtype), so a Megatron user's
`.bin/.idx` files train here as they are and ours train there."""
import json
import warnings

import numpy as np
import pytest

from llamapipe.data.indexed_dataset import IndexedDataset
from llamapipe.tools import preprocess_data

with warnings.catch_warnings():          # megatron-core warns that Transformer Engine and apex are absent
    warnings.simplefilter("ignore")
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                reason="megatron-core is not installed: `pip install --no-deps megatron-core` "
                                       "(docs/testing.md)")


def _corpus(tmp_path, vocab: int) -> list[list[int]]:
    """Documents of NullTokenizer ids (the text is the ids), long and short, ids up to vocab - 1."""
    docs = [[(i * 7919 + j * 104729) % vocab for j in range(1 + (i * 13) % 41)] for i in range(120)]
    with open(tmp_path / "docs.jsonl", "w") as fh:
        for d in docs:
            fh.write(json.dumps({"text": " ".join(map(str, d))}) + "\n")
    return docs


@pytest.mark.parametrize("vocab", [1000, 100_000], ids=["uint16", "int32"])
def test_megatron_core_reads_what_preprocess_writes(tmp_path, vocab):
    docs = _corpus(tmp_path, vocab)
    prefix = str(tmp_path / "ours")
    assert preprocess_data.main(["--input", str(tmp_path / "docs.jsonl"), "--output-prefix", prefix,
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--append-eod",
                                 "--no-progress"]) == 0
    theirs = mcore.IndexedDataset(prefix + "_text_document")
    assert len(theirs) == len(docs)
    assert theirs.index.dtype == (np.uint16 if vocab < 65500 else np.int32)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert theirs[i].tolist() == doc + [vocab], i          # eod = vocab for NullTokenizer
        n = min(2, len(doc))                                    # megatron-core does not clip at the sequence end
        assert theirs.get(i, offset=1, length=n).tolist() == (doc + [vocab])[1:1 + n]
    ours = IndexedDataset(prefix + "_text_document")
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_our_reader_reads_what_megatron_core_builds(tmp_path, dtype):
    """Documents of several sequences too (add_item then end_document), as Megatron's sentence splitting writes."""
    rng = np.random.default_rng(0)
    items = [rng.integers(0, 60_000, size=int(n)).astype(dtype) for n in rng.integers(1, 50, size=90)]
    ends = {2, 3, 10, 40, 41, 89}           # a document ends after these items
    prefix = str(tmp_path / "theirs")
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    import torch
    for i, item in enumerate(items):
        builder.add_item(torch.from_numpy(item.astype(np.int64)))
        if i in ends:
            builder.end_document()
    builder.finalize(prefix + ".idx")
    ours, theirs = IndexedDataset(prefix), mcore.IndexedDataset(prefix)
    assert ours.dtype == np.dtype(dtype) and len(ours) == len(items)
    for i, item in enumerate(items):
        assert ours[i].tolist() == item.tolist(), i
        assert ours.get(i, offset=1).tolist() == theirs.get(i, offset=1).tolist()
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    np.testing.assert_array_equal(ours.document_indices, [0] + [i + 1 for i in sorted(ends)])
    assert ours.num_tokens == sum(len(x) for x in items)
