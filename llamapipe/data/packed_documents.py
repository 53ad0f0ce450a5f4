"""Document boundaries inside packed samples: Megatron's --reset-position-ids, --reset-attention-mask and
--eod-mask-loss (its `_get_ltor_masks_and_position_ids`, megatron/core/datasets/gpt_dataset.py).

A sample is a window of seq_length tokens cut across documents, each document ending in the tokenizer's
end-of-document (EOD) token (`llamapipe preprocess --append-eod`). A document ends at its EOD token, inclusive:

- `document_ids` (--reset-attention-mask): per token, how many EOD tokens come before it in the sample, so the
  tokens of one document share an id; the model attends within each document (core/document_attention.py).
  Megatron builds the (s, s) boolean mask here; its per-token ids carry the same information in s integers.
- `position_ids` (--reset-position-ids): per token, its offset from its document's first token in the sample.
- `loss_mask` (--eod-mask-loss): 0 where the input token is EOD, whose label is the next document's first
  token; 1 elsewhere.

Each field is computed only when its flag is on, as in Megatron, so the three combine freely.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from llamapipe.core.config import DataConfig


@dataclass(frozen=True)
class PackedDocuments:
    """Which of the three flags are on, and the EOD token id they read."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def of(cls, data: DataConfig) -> Optional["PackedDocuments"]:
        """From the data config; None when none of the flags is on."""
        if not data.packed_documents:
            return None
        assert data.eod_id is not None, "the arguments set eod_id whenever a document flag is on"
        return cls(data.eod_id, data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss)

    def fields(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The sample's extra fields for its input `tokens` (s,), and its loss mask."""
        eod = tokens == self.eod
        out = {"loss_mask": (~eod).float() if self.eod_mask_loss else torch.ones(len(tokens))}
        documents = torch.cat([torch.zeros(1, dtype=torch.long), eod[:-1].long().cumsum(0)])   # EODs before each
        if self.reset_attention_mask:
            out["document_ids"] = documents
        if self.reset_position_ids:
            index = torch.arange(len(tokens))
            starts = torch.zeros(int(documents[-1]) + 1, dtype=torch.long)
            starts[1:] = index[eod][:len(starts) - 1] + 1        # the first token of each document
            out["position_ids"] = index - starts[documents]
        return out
