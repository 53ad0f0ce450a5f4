"""Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss) through the training setup on
gloo ranks: a global batch of packed samples gives the loss and gradients of its documents trained alone.

The data is a real .bin/.idx dataset of documents each ending in the end-of-document token, read by the
training's own iterators (`setup.build_iterators`: GPT samples cut across documents, every pipeline chunk
reading its microbatches), run by the schedule's forward-backward with `setup.forward_step`, and reduced by
`finalize_model_grads`. The reference is one process that cuts every sample at its documents' boundaries and
runs each piece alone through the model as a sequence of its own (positions from 0, plain causal attention,
no document ids), summing the masked token losses and their gradients. Both are divided by the global batch's
loss tokens and must agree (fp32, rel 1e-5) at tp 2 with sequence parallelism, pp 2 under ZB-V (the two middle
stages on rank 1 read the document ids too), cp 2 with the ring and with the all-gather, and under --compile.
"""
import numpy as np
import pytest
import torch

from llamapipe.core.config import DataConfig, ParallelConfig, TrainingConfig
from llamapipe.data.indexed_dataset import IndexedDatasetWriter
from llamapipe.model.llama import LlamaConfig
from llamapipe.training.config import Config
from tests.harness import run_distributed

pytestmark = pytest.mark.slow

MODEL = LlamaConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                    vocab_size=64, max_position_embeddings=32, make_vocab_size_divisible_by=32)
EOD, SEQ, MBS, GBS = 63, 32, 2, 4
CASES = {  # name: (parallel config, --compile)
    "tp2 sp": (ParallelConfig(world_size=2, tp_size=2, sequence_parallel=True), False),
    "pp2 zbv": (ParallelConfig(world_size=2, pp_size=2, vpp_size=2, pipeline_schedule="zbv"), False),
    "cp2 p2p": (ParallelConfig(world_size=2, cp_size=2, cp_comm_type="p2p"), False),
    "cp2 allgather": (ParallelConfig(world_size=2, cp_size=2, cp_comm_type="allgather"), False),
}
COMPILED = {"compiled": (ParallelConfig(), True)}   # one rank: inductor's work is the same on every layout


def _write_documents(prefix: str) -> None:
    """60 documents of 2 to 24 tokens, each ending in EOD: a sample of 32 tokens holds several and cuts some."""
    rng = np.random.default_rng(3)
    writer = IndexedDatasetWriter(prefix)
    for _ in range(60):
        body = rng.integers(0, EOD, size=int(rng.integers(1, 24)))
        writer.add_document(np.append(body, EOD))
    writer.finalize()


def _config(parallel: ParallelConfig, prefix: str, cache: str, compile: bool) -> Config:
    data = DataConfig(data_path=(prefix,), split="100,0,0", data_cache_path=cache, num_workers=0,
                      reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, eod_id=EOD)
    training = TrainingConfig(micro_batch_size=MBS, global_batch_size=GBS, seq_length=SEQ, train_iters=1,
                              eval_iters=0, num_microbatches=GBS // MBS, compile=compile)
    return Config(model=MODEL, parallel=parallel, training=training, data=data)


def _grads(chunks: list, ps) -> dict:
    """Every parameter's full logical gradient on this rank (gathered over TP, the vocabulary padding cut)."""
    from llamapipe.core.tensor_parallel.layers import gather_logical_tensor
    grads = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            full = gather_logical_tensor(p.grad, p, ps.tp_group)
            grads[name] = full[:MODEL.vocab_size] if getattr(p, "vocab_padded", False) else full
    return grads


def _worker(rank: int, world_size: int, prefix: str, cache: str, tokens: int, cases: dict) -> dict:
    import torch.distributed as dist
    from llamapipe.core.distributed.grad_reduce import finalize_model_grads
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.training import setup
    out = {}
    for name, (parallel, compile) in cases.items():
        ps = initialize_model_parallel(parallel.tp_size, parallel.pp_size, parallel.vpp_size, cp=parallel.cp_size)
        try:
            config = _config(parallel, prefix, cache, compile)
            chunks, roles = setup.build_model_chunks(config, MODEL, ps, torch.device("cpu"))
            train, _ = setup.build_iterators(config, MODEL, ps, roles, consumed_samples=0)
            fb = setup.build_forward_backward_func(config, ps)
            losses = fb(forward_step_func=setup.forward_step, data_iterator=train, model=chunks,
                        num_microbatches=GBS // MBS)
            loss_sum = torch.tensor([sum(float(o["loss_sum"]) for o in losses)], dtype=torch.float64)
            dist.all_reduce(loss_sum)     # each CP rank holds its tokens' part, one pipeline rank holds the loss
            finalize_model_grads(chunks, ps, None, global_tokens=tokens)
            out[name] = (float(loss_sum) / (ps.tp_size * tokens), _grads(chunks, ps))
        finally:
            destroy_model_parallel()
    return out


def _samples(prefix: str, cache: str) -> list[dict]:
    """The global batch's samples in the order the sampler reads them (one data-parallel rank)."""
    from llamapipe.data.gpt_dataset import build_gpt_datasets
    from llamapipe.data.packed_documents import PackedDocuments
    config = _config(CASES["tp2 sp"][0], prefix, cache, False)
    train = build_gpt_datasets(config.data.data_path, config.data.split, [GBS, 0, 0], SEQ, config.training.seed,
                               cache, documents=PackedDocuments.of(config.data))[0]
    return [train[i] for i in range(GBS)]


def _documents_alone(samples: list[dict]) -> tuple[float, dict, int]:
    """Masked loss sum, gradients and loss tokens of every document of every sample run alone."""
    from llamapipe.model.llama import LlamaModel
    model, total, tokens = LlamaModel(MODEL), 0.0, 0
    for sample in samples:
        bounds = torch.unique_consecutive(sample["document_ids"], return_counts=True)[1].cumsum(0).tolist()
        for start, end in zip([0] + bounds[:-1], bounds):
            piece = slice(start, end)
            losses = model(sample["tokens"][None, piece], labels=sample["labels"][None, piece])
            loss = (losses * sample["loss_mask"][None, piece]).sum()
            loss.backward()
            total += float(loss.detach())
            tokens += int(sample["loss_mask"][piece].sum())
    grads = {n: p.grad / tokens for n, p in model.named_parameters()}
    return total / tokens, grads, tokens


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """(prefix, cache directory, the reference's loss, gradients and loss tokens)."""
    tmp = tmp_path_factory.mktemp("packed")
    prefix, cache = str(tmp / "docs"), str(tmp / "cache")
    _write_documents(prefix)
    samples = _samples(prefix, cache)
    assert all(int(s["document_ids"][-1]) >= 1 for s in samples), "every sample packs several documents"
    return prefix, cache, *_documents_alone(samples)


@pytest.mark.parametrize("cases", [CASES, COMPILED], ids=["layouts", "compiled"])
def test_packed_documents_train_as_documents_alone(dataset, cases):
    prefix, cache, ref_loss, ref_grads, tokens = dataset
    world_size = max(parallel.world_size for parallel, _ in cases.values())
    per_rank = run_distributed(_worker, world_size, prefix, cache, tokens, cases, timeout=600)
    for name in cases:
        for rank, result in enumerate(per_rank):
            loss, grads = result[name]
            assert abs(loss - ref_loss) <= 1e-5 * ref_loss, f"{name} rank {rank}: loss {loss} vs {ref_loss}"
        grads = {n: g for result in per_rank for n, g in result[name][1].items()}
        assert set(grads) == set(ref_grads), name
        for param, ref in ref_grads.items():
            torch.testing.assert_close(grads[param], ref, rtol=1e-5, atol=1e-7, msg=f"{name} {param}")

