"""TP=2/4 (gloo processes) and pipeline chunks against the single-rank model: loss, logits and gradients; and
the spec's q/k norm part (per-head norms, Qwen3's) at TP=2."""
import zlib

import pytest
import torch

from llamapipe.core.tensor_parallel.layers import allreduce_sequence_parallel_grads, gather_logical_tensor
from llamapipe.model.llama import LlamaConfig, LlamaModel
from llamapipe.model.spec import ModelSpec
from tests.harness import run_distributed

# vocab 1003 padded to a multiple of 100 x tp: 1100 rows at TP=1, 1200 at TP=2 and 4 (one shard all padding-heavy)
CONFIG = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8, num_query_groups=4,
                     vocab_size=1003, max_position_embeddings=32, rope_theta=20000.0,
                     make_vocab_size_divisible_by=100)
CASES = [(False, None), (True, None), (False, "full"), (True, "full"), (False, "selective"), (True, "selective")]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]  # s = 8, divisible by tp for sequence parallel


def _portable(obj):
    """Tensors -> numpy so results survive the rank process exiting (torch queues share tensor memory)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    return obj


def _tensors(obj):
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors(v) for v in obj)
    return torch.from_numpy(obj) if hasattr(obj, "dtype") else obj


def _run_step(model: LlamaModel, input_ids, labels, tp_group) -> tuple[torch.Tensor, dict]:
    """Mean token loss and gathered logical gradients (vocab rows cut to vocab_size)."""
    loss = model(input_ids, labels=labels).mean()
    loss.backward()
    allreduce_sequence_parallel_grads(model, tp_group)
    grads = {}
    for name, p in model.named_parameters():
        grad = gather_logical_tensor(p.grad, p, tp_group)
        grads[name] = grad[:CONFIG.vocab_size] if getattr(p, "vocab_padded", False) else grad
    return loss.detach(), grads


def _tp_worker(rank: int, world_size: int, cases: list, with_pipeline: bool) -> tuple:
    """Every (sequence_parallel, recompute) case, then optionally the two-chunk split with sequence parallel."""
    from llamapipe.core.parallel_state import initialize_model_parallel
    state = initialize_model_parallel(tp=world_size)
    input_ids, labels = _batch()
    out = []
    for sequence_parallel, recompute in cases:
        config = CONFIG.replace(recompute_granularity=recompute, recompute_num_layers=1 if recompute else None)
        model = LlamaModel(config, state, sequence_parallel=sequence_parallel)
        with torch.no_grad():
            logits = model(input_ids)
        loss, grads = _run_step(model, input_ids, labels, state.tp_group)
        out.append((loss, grads, logits) if rank == 0 else None)
    pipeline = _pipeline_step(CONFIG, state, sequence_parallel=True) if with_pipeline else None
    return _portable((out, pipeline))


def _reference() -> tuple[torch.Tensor, dict, torch.Tensor]:
    model = LlamaModel(CONFIG)
    input_ids, labels = _batch()
    with torch.no_grad():
        logits = model(input_ids)
    loss, grads = _run_step(model, input_ids, labels, None)
    return loss, grads, logits


@pytest.mark.slow
@pytest.mark.parametrize("tp_size, cases", [(2, CASES), (4, [CASES[1], CASES[2], CASES[5]])])
def test_tp_matches_single_rank(tp_size, cases):
    """Loss, logits and gathered grads at TP=2/4 (+SP, +full/selective recompute) equal TP=1 (rel 1e-5).

    At TP=2 the same ranks also run two pipeline chunks with sequence parallel: they send (s/tp, b, h)
    and match the whole TP=1 model.
    """
    ref_loss, ref_grads, ref_logits = _reference()
    results, pipeline = _tensors(run_distributed(_tp_worker, tp_size, cases, tp_size == 2, timeout=240)[0])
    for (sequence_parallel, recompute), (loss, grads, logits) in zip(cases, results):
        case = f"tp={tp_size} sp={sequence_parallel} recompute={recompute}"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=case)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6, msg=case)
        assert set(grads) == set(ref_grads), case
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=f"{case} {name}")
    if pipeline is not None:
        loss, grads, sent_shape = pipeline
        assert sent_shape == (4, 2, CONFIG.hidden_size)  # (s/tp, b, h)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=f"pipeline tp=2 sp {name}")


def _pipeline_step(config: LlamaConfig, state=None, sequence_parallel: bool = False) -> tuple[torch.Tensor, dict]:
    """Two chunks (layers [0,1) with embedding, [1,2) with head) joined through set_input_tensor."""
    first = LlamaModel(config, state, layer_range=(0, 1), post_process=False, sequence_parallel=sequence_parallel)
    second = LlamaModel(config, state, layer_range=(1, 2), pre_process=False, sequence_parallel=sequence_parallel)
    input_ids, labels = _batch()
    sent = first(input_ids)
    received = sent.detach().requires_grad_()
    second.set_input_tensor(received)
    loss = second(labels=labels).mean()
    loss.backward()
    sent.backward(received.grad)
    tp_group = state.tp_group if state is not None else None
    for chunk in (first, second):
        allreduce_sequence_parallel_grads(chunk, tp_group)
    grads = {}
    for chunk in (first, second):
        for name, p in chunk.named_parameters():
            grad = gather_logical_tensor(p.grad, p, tp_group)
            grads[name] = grad[:config.vocab_size] if getattr(p, "vocab_padded", False) else grad
    return loss.detach(), grads, tuple(sent.shape)


def test_two_chunks_equal_whole_model():
    """Embedding chunk + head chunk (layer_range split, set_input_tensor) give the whole model's loss/grads."""
    ref_loss, ref_grads, _ = _reference()
    loss, grads, sent_shape = _pipeline_step(CONFIG)
    assert sent_shape == (8, 2, CONFIG.hidden_size)  # (s, b, h)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=name)


def test_parameter_attributes():
    """Every parameter carries Megatron's TP attributes; vocab tensors are marked padded."""
    model = LlamaModel(CONFIG)
    for name, p in model.named_parameters():
        assert isinstance(p.tensor_model_parallel, bool) and isinstance(p.partition_dim, int), name
        expected_dim = {"o_proj": 1, "down_proj": 1, "norm": -1}
        dim = next((d for key, d in expected_dim.items() if key in name), 0)
        assert p.partition_dim == dim and p.tensor_model_parallel == (dim >= 0), name
    assert model.embedding.weight.vocab_padded and model.output.weight.vocab_padded
    assert model.embedding.weight.shape[0] == CONFIG.padded_vocab_size(1) == 1100


class _QKNormModel(LlamaModel):
    """LLaMA's chunk with a norm over each head of q and k before RoPE (the spec part Qwen3 uses)."""

    spec = ModelSpec(qk_norm=True)


def _qk_norm_model(state=None, sequence_parallel: bool = False) -> LlamaModel:
    """The chunk with its q/k norm scales away from one (as trained ones are), the same on every rank."""
    model = _QKNormModel(CONFIG, state, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model


def _qk_norm_worker(rank: int, world_size: int) -> dict:
    from llamapipe.core.parallel_state import initialize_model_parallel
    state = initialize_model_parallel(tp=world_size)
    return _portable({sp: _run_step(_qk_norm_model(state, sp), *_batch(), state.tp_group) for sp in (False, True)})


def test_qk_norm_grads_are_summed_over_tp():
    """At TP=2, with and without sequence parallelism, the loss and every gradient of a chunk with per-head q/k
    norms equal TP=1's (rel 1e-5): each rank's q/k norm gradient covers only its heads until the TP sum
    (`per_head`); the norms are replicated and not sequence-parallel."""
    weight = _qk_norm_model().layers["0"].attention.q_norm.weight
    assert weight.shape == (CONFIG.head_dim,) and weight.per_head and not weight.sequence_parallel
    assert weight.partition_dim == -1 and not weight.tensor_model_parallel
    ref_loss, ref_grads = _run_step(_qk_norm_model(), *_batch(), None)
    assert "layers.1.attention.k_norm.weight" in ref_grads
    for rank, per_sp in enumerate(_tensors(run_distributed(_qk_norm_worker, 2, timeout=240))):
        for sp, (loss, grads) in per_sp.items():
            case = f"tp rank {rank} sp={sp}"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=case)
            assert set(grads) == set(ref_grads), case
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=f"{case} {name}")
