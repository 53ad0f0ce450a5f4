"""The .npy cache of a GPT dataset's document, sample and shuffle indices: built once, written atomically, and
checked against the dataset whenever it is read back.

A cache directory may be shared, and a file in it cut short (a full disk under an older version, a copy) or
edited: a shuffle index pointing past the samples gave an IndexError traceback from a DataLoader worker, a
truncated file numpy's "mmap length is greater than file size" naming no file (issue 51). Each file is now read
in one try naming it, and the three arrays are checked for shape, dtype and range against the documents they
index before any is used; a bad one is one line naming the file and the fix (delete it: it is rebuilt).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np

from llamapipe.core.logger import get_logger
from llamapipe.safe_files import replace_atomically

NAMES = ("doc_idx", "sample_idx", "shuffle_idx")
Indices = tuple[np.ndarray, np.ndarray, np.ndarray]


def load_or_build(base: str, build: Callable[[], Indices], sequence_lengths: np.ndarray,
                  doc_range: tuple[int, int], num_samples: int, seq_length: int) -> Indices:
    """The indices cached at `base`-{name}.npy when all three are there and fit the dataset, else `build()`'s,
    cached. ValueError (one line naming the file) when a cached file is unreadable or does not fit."""
    paths = [f"{base}-{n}.npy" for n in NAMES]
    if all(os.path.isfile(p) for p in paths):
        arrays = tuple(_read(p) for p in paths)
        defect = cache_defect(arrays, sequence_lengths, doc_range, num_samples, seq_length)
        if defect is not None:
            name, why = defect
            raise ValueError(_refusal(paths[NAMES.index(name)], why))
        return arrays
    start = time.perf_counter()
    arrays = build()
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for path, array in zip(paths, arrays):
        with replace_atomically(path) as fh:    # whole or not at all, never through a link
            np.save(fh, array)
    get_logger().info("built %s indices (%d samples) in %.2fs -> %s", os.path.basename(base),
                      len(arrays[2]), time.perf_counter() - start, os.path.dirname(base))
    return arrays


def _refusal(path: str, why: str) -> str:
    return (f"data index cache {path} {why}; delete it (the three {os.path.basename(path).rsplit('-', 1)[0]}-*.npy "
            "files) and it is rebuilt from the data")


def _read(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(_refusal(path, f"cannot be read ({str(err).splitlines()[0] or type(err).__name__}); "
                                        "it is cut short or not a .npy file")) from None


def cache_defect(arrays: tuple, sequence_lengths: np.ndarray, doc_range: tuple[int, int], num_samples: int,
                 seq_length: int) -> Optional[tuple[str, str]]:
    """(array name, what is wrong) for the first of (doc_idx, sample_idx, shuffle_idx) that does not index
    documents [doc_range) of this dataset in at least `num_samples` samples, else None."""
    doc_idx, sample_idx, shuffle_idx = arrays
    for name, array, ndim in zip(NAMES, arrays, (1, 2, 1)):
        if array.ndim != ndim or array.dtype.kind not in "iu" or (ndim == 2 and array.shape[1] != 2):
            return name, f"holds a {array.dtype} array of shape {array.shape}, not the index it should"
    first, last = doc_range
    if not len(doc_idx) or doc_idx.min() < first or doc_idx.max() >= last:
        return "doc_idx", f"names documents outside this split's {first}:{last}"
    if len(sample_idx) < 2 or sample_idx[:, 0].min() < 0 or sample_idx[:, 0].max() >= len(doc_idx):
        return "sample_idx", f"points outside the {len(doc_idx)} entries of the document index"
    lengths = sequence_lengths[doc_idx].astype(np.int64)
    position, offsets = sample_idx[:, 0].astype(np.int64), sample_idx[:, 1].astype(np.int64)
    if offsets.min() < 0 or (offsets >= lengths[position]).any():
        return "sample_idx", "holds offsets beyond the end of their documents"
    starts = np.cumsum(lengths)[position] - lengths[position] + offsets     # each window's first token
    if (np.diff(starts) != seq_length).any():
        return "sample_idx", f"holds windows of other than --seq-length {seq_length} tokens"
    if len(shuffle_idx) < num_samples:
        return "shuffle_idx", f"holds {len(shuffle_idx)} samples, fewer than the {num_samples} asked for"
    if len(shuffle_idx) and (shuffle_idx.min() < 0 or shuffle_idx.max() >= len(sample_idx) - 1):
        return "shuffle_idx", (f"holds sample numbers from {shuffle_idx.min()} to {shuffle_idx.max()}, outside "
                               f"the {len(sample_idx) - 1} samples of its sample index")
    return None
