"""Document boundaries of packed samples (data/packed_documents.py) against Megatron's own loop, in GPT and mock
samples, and the three flags from the command line to the data config."""
import itertools

import numpy as np
import pytest
import torch

from llamapipe.data.gpt_dataset import GPTDataset, MockGPTDataset
from llamapipe.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from llamapipe.data.packed_documents import PackedDocuments
from llamapipe.core.config import ArgumentError
from llamapipe.training.arguments.parser import build_parser, config_from_args
from llamapipe.training.startup import startup_lines

EOD = 9


def _megatron(tokens: torch.Tensor, reset_position_ids: bool, reset_attention_mask: bool,
              eod_mask_loss: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron-LM's _get_ltor_masks_and_position_ids as its loop reads: (attention allowed (s, s), loss mask,
    position ids)."""
    s = len(tokens)
    allowed = torch.ones(s, s).tril().bool()
    loss_mask = torch.ones(s)
    if eod_mask_loss:
        loss_mask[tokens == EOD] = 0.0
    position_ids = torch.arange(s)
    prev = 0
    for i in torch.arange(s)[tokens == EOD].tolist():
        if reset_attention_mask:
            allowed[i + 1:, :i + 1] = False
        if reset_position_ids:
            position_ids[i + 1:] -= i + 1 - prev
            prev = i + 1
    return allowed, loss_mask, position_ids


@pytest.mark.parametrize("flags", list(itertools.product((False, True), repeat=3))[1:])
def test_fields_follow_megatron(flags):
    rng = np.random.default_rng(4)
    for tokens in (torch.tensor([EOD, 1, 2, EOD, EOD, 3, 4, 5, EOD]), torch.from_numpy(rng.integers(0, 10, 40))):
        fields = PackedDocuments(EOD, *flags).fields(tokens)
        allowed, loss_mask, position_ids = _megatron(tokens, *flags)
        torch.testing.assert_close(fields["loss_mask"], loss_mask, rtol=0, atol=0)
        assert ("position_ids" in fields) == flags[0] and ("document_ids" in fields) == flags[1]
        if flags[0]:
            assert torch.equal(fields["position_ids"], position_ids)
        if flags[1]:
            docs = fields["document_ids"]
            mine = (docs[:, None] == docs[None, :]) & torch.ones(len(tokens), len(tokens)).tril().bool()
            assert torch.equal(mine, allowed)


def test_gpt_and_mock_samples_carry_their_documents(tmp_path):
    writer = IndexedDatasetWriter(str(tmp_path / "d"))
    for n in (3, 7, 2, 12, 5, 6):
        writer.add_document(np.append(np.arange(1, n), EOD))
    writer.finalize()
    documents = PackedDocuments(EOD, True, True, True)
    gpt = GPTDataset(IndexedDataset(str(tmp_path / "d")), (0, 6), 3, 8, 1, "train", str(tmp_path / "c"), documents)
    mock = MockGPTDataset(3, 8, EOD + 1, 1, documents)
    for sample in [gpt[i] for i in range(3)] + [mock[i] for i in range(3)]:
        want = documents.fields(sample["tokens"])
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
        for key, value in want.items():
            assert torch.equal(sample[key], value), key
    assert any(int(gpt[i]["document_ids"][-1]) > 0 for i in range(3))


BASE = ("--mock-data --seq-length 32 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 2 --train-iters 2").split()


def test_flags_read_the_tokenizers_end_of_document_id_and_the_run_block_says_so():
    args = build_parser().parse_args(BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                                             "--reset-attention-mask", "--eod-mask-loss"])
    config = config_from_args(args, 1)
    data = config.data
    assert (data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss, data.eod_id) == (
        False, True, True, 100)
    assert startup_lines(config)[-1] == ("run: packed documents: attention within each document, no loss on "
                                         "end-of-document tokens (end-of-document id 100)")
    plain = config_from_args(build_parser().parse_args(BASE + ["--vocab-size", "100"]), 1)
    assert not plain.data.packed_documents and plain.data.eod_id is None
    assert not any("packed documents" in line for line in startup_lines(plain))


def test_flags_without_a_tokenizer_or_with_post_validation_are_one_sentence():
    args = build_parser().parse_args(BASE + ["--vocab-size", "100", "--reset-position-ids"])
    with pytest.raises(ArgumentError, match=r"^--reset-position-ids needs the end-of-document token id of a "
                                            r"tokenizer: give --tokenizer-model, or --tokenizer-type NullTokenizer"):
        config_from_args(args, 1)
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--enable-optimizer-post-validation"]
    args = build_parser().parse_args(BASE + null + ["--eod-mask-loss"])
    with pytest.raises(ArgumentError, match=r"^--eod-mask-loss cannot be used with --enable-optimizer-post-validation"):
        config_from_args(args, 1)
    assert config_from_args(build_parser().parse_args(BASE + null + ["--reset-attention-mask"]), 1).data.eod_id == 100
