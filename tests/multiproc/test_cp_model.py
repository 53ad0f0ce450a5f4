"""A LLaMA model under context parallelism (gloo ranks) against the single-rank model.

Each CP rank runs the whole model (pp 1) on the whole sequence, of which it keeps its load-balanced share
(the chunk's `sequence_shard`); its
per-token losses, unsharded, and its parameter gradients, summed over the CP ranks (what the gradient
reduction over dp x cp does), must equal the single-rank model's (fp32, rel 1e-5): for both comm types, with
selective and full recompute, with the weight gradients deferred to W (zero-bubble B/W split), with GQA
and without, and at cp 2 + tp 2 + sequence parallel. In bf16 they are as close to fp32 as one rank's; the
saved activations per rank halve.
"""
import torch

from llamapipe.core.context_parallel import unshard_sequence
from llamapipe.core.pipeline_parallel.activation_memory import saved_storages
from llamapipe.core.tensor_parallel.layers import allreduce_sequence_parallel_grads, gather_logical_tensor
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.model.llama import LlamaConfig, LlamaModel
from llamapipe.model.qwen2 import Qwen2Config, Qwen2Model
from tests.harness import run_distributed

CONFIG = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8, num_query_groups=4,
                     vocab_size=200, max_position_embeddings=32, make_vocab_size_divisible_by=100)
B, S = 2, 16
# (name, comm type, config changes, deferred weight grads)
CASES = [("p2p", "p2p", {}, False), ("allgather", "allgather", {}, False),
         ("p2p selective", "p2p", dict(recompute_granularity="selective"), False),
         ("allgather full", "allgather", dict(recompute_granularity="full"), False),
         ("p2p mha B/W split", "p2p", dict(num_query_groups=8), True),
         ("qwen2 allgather", "allgather", dict(family="qwen2"), False),
         ("two chunks", "p2p", {}, False)]   # two pipeline stages in one process
DEFERRED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
            "up_proj.weight", "down_proj.weight", "output.weight")


def _batch() -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CONFIG.vocab_size, (B, S + 1), generator=g)
    mask = torch.ones(B, S)
    mask[0, 3] = 0.0      # a masked token, so the loss mask travels with its token
    return {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask}


def _model(changes: dict, state=None, **kw) -> LlamaModel:
    changes = dict(changes)
    if changes.pop("family", None) == "qwen2":
        return Qwen2Model(Qwen2Config(**{**CONFIG.__dict__, "family": "qwen2", **changes}), state, **kw)
    return LlamaModel(CONFIG.replace(**changes), state, **kw)


def _step(model: LlamaModel, batch: dict, tp_group, deferred: bool) -> tuple[torch.Tensor, dict, list]:
    """Per-token losses, logical gradients of the loss summed over the global batch's tokens / (b * s), and
    the parameters that had no gradient after B (when the weight gradients are deferred)."""
    store = WeightGradStore()
    with store.active():
        losses = model(batch["tokens"], labels=batch["labels"])
    loss = (losses * model.sequence_shard(batch["loss_mask"])).sum() / (B * S)
    with store.capture("mb") if deferred else store.active():
        loss.backward()
    after_b = sorted(n for n, p in model.named_parameters() if p.grad is None)
    if deferred:
        store.run("mb")
    store.assert_empty()
    allreduce_sequence_parallel_grads(model, tp_group)
    grads = {n: gather_logical_tensor(p.grad, p, tp_group)[:CONFIG.vocab_size] if getattr(p, "vocab_padded", False)
             else gather_logical_tensor(p.grad, p, tp_group) for n, p in model.named_parameters()}
    return losses.detach(), grads, after_b


def _two_chunks_step(state, batch: dict, tp_group, sequence_parallel: bool) -> tuple[torch.Tensor, dict, list]:
    """Layers [0, 1) with the embedding, then [1, 2) with the head, joined as pipeline stages are
    (set_input_tensor); the first stage is given the sequence's positions (which it cuts), the second none, as
    a later pipeline stage is not."""
    kw = dict(sequence_parallel=sequence_parallel)
    first = LlamaModel(CONFIG, state, layer_range=(0, 1), post_process=False, **kw)
    second = LlamaModel(CONFIG, state, layer_range=(1, 2), pre_process=False, **kw)
    sent = first(batch["tokens"], position_ids=torch.arange(S).expand(B, -1))
    received = sent.detach().requires_grad_()
    second.set_input_tensor(received)
    losses = second(labels=batch["labels"])
    ((losses * second.sequence_shard(batch["loss_mask"])).sum() / (B * S)).backward()
    sent.backward(received.grad)
    grads = {}
    for chunk in (first, second):
        allreduce_sequence_parallel_grads(chunk, tp_group)
        grads.update((n, gather_logical_tensor(p.grad, p, tp_group)) for n, p in chunk.named_parameters())
    grads["output.weight"] = grads["output.weight"][:CONFIG.vocab_size]
    return losses.detach(), grads, []


def _worker(rank: int, world_size: int, tp: int, cases: list, sequence_parallel: bool) -> dict:
    from llamapipe.core.parallel_state import initialize_model_parallel
    state = initialize_model_parallel(tp=tp, cp=world_size // tp)
    batch = _batch()
    out = {"cp_rank": state.cp_rank, "tp_rank": state.tp_rank}
    for name, comm, changes, deferred in cases:
        if name == "two chunks":
            out[name] = _two_chunks_step(state, batch, state.tp_group, sequence_parallel)
            continue
        model = _model(changes, state, cp_comm_type=comm, sequence_parallel=sequence_parallel)
        out[name] = _step(model, batch, state.tp_group, deferred)
    return out


def _check(tp: int, cp: int, cases: list, sequence_parallel: bool = False) -> None:
    results = run_distributed(_worker, tp * cp, tp, cases, sequence_parallel, timeout=300)
    by_cp = sorted((r for r in results if r["tp_rank"] == 0), key=lambda r: r["cp_rank"])
    assert [r["cp_rank"] for r in by_cp] == list(range(cp))
    for name, _, changes, deferred in cases:
        ref_losses, ref_grads, _ = _step(_model(changes), _batch(), None, False)
        case = f"cp={cp} tp={tp} sp={sequence_parallel} {name}"
        losses = unshard_sequence([r[name][0] for r in by_cp], dim=1)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6, msg=case)
        assert set(by_cp[0][name][1]) == set(ref_grads), case
        for param, ref in ref_grads.items():
            summed = sum(r[name][1][param] for r in by_cp)
            torch.testing.assert_close(summed, ref, rtol=1e-5, atol=1e-7, msg=f"{case} {param}")
        if deferred:   # B left exactly the linear layers' weight gradients to W
            after_b = by_cp[0][name][2]
            assert after_b and all(n.endswith(DEFERRED) for n in after_b), after_b
            assert len(after_b) == 7 * CONFIG.num_layers + 1, after_b


def test_cp2_matches_single_rank():
    """cp 2, p2p and allgather, recompute, B/W split, MHA, Qwen2's biases, two pipeline chunks: losses and
    summed grads (rel 1e-5)."""
    _check(1, 2, CASES)


def test_cp2_tp2_sequence_parallel_matches_single_rank():
    """cp 2 x tp 2 with sequence parallelism (4 ranks), also as two pipeline chunks: (s/cp/tp, b, h)
    activations, same losses and grads."""
    _check(2, 2, [CASES[0], CASES[1], CASES[-1]], sequence_parallel=True)


def _saved_bytes(state, comm: str, seq_len: int) -> int:
    """Bytes the forward of one microbatch (b 1, `seq_len` tokens) saves for backward on this rank."""
    config = CONFIG.replace(max_position_embeddings=seq_len)
    model = LlamaModel(config, state, cp_comm_type=comm)
    ids = torch.randint(0, config.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    losses = model(ids[:, :-1], labels=ids[:, 1:])
    weights = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    return sum(s.nbytes() for s in saved_storages(losses, weights).values())


def _memory_worker(rank: int, world_size: int, seq_len: int) -> dict:
    from llamapipe.core.parallel_state import initialize_model_parallel
    state = initialize_model_parallel(cp=world_size)
    return {comm: _saved_bytes(state, comm, seq_len) for comm in ("p2p", "allgather")}


def test_cp_divides_saved_activations():
    """Saved activations per rank at cp 2 are at most 0.52x of one rank's (issue 30 asks 0.55x at cp 2):
    attention saves only the local q, k, v, output and log-sum-exp, never the gathered or passed K/V."""
    seq_len = 512
    single = _saved_bytes(None, "p2p", seq_len)
    for rank, per_comm in enumerate(run_distributed(_memory_worker, 2, seq_len)):
        for comm, saved in per_comm.items():
            assert saved <= 0.52 * single, f"rank {rank} {comm}: {saved} bytes saved, {saved / single:.3f}x cp 1's"


def _half_worker(rank: int, world_size: int) -> dict:
    from llamapipe.core.parallel_state import initialize_model_parallel
    state = initialize_model_parallel(cp=world_size)
    return {comm: _step(_model({}, state, cp_comm_type=comm, params_dtype=torch.bfloat16), _batch(), None, False)
            for comm in ("p2p", "allgather")}


def test_cp2_bf16_is_as_close_to_fp32_as_one_rank():
    """bf16 weights and activations at cp 2: losses and summed gradients are as close to the fp32 model's as
    the bf16 model on one rank is (within 2x its error, plus 1e-6 for gradients that round to zero; measured at
    most 0.65 of that bound). The gradients of two bf16 halves are summed in fp32 here, as the reduction does."""
    exact_losses, exact_grads, _ = _step(_model({}), _batch(), None, False)
    one_losses, one_grads, _ = _step(_model({}, params_dtype=torch.bfloat16), _batch(), None, False)
    results = run_distributed(_half_worker, 2)
    for comm in ("p2p", "allgather"):
        losses = unshard_sequence([r[comm][0].float() for r in results], dim=1)
        pairs = [("losses", losses, one_losses.float(), exact_losses)]
        pairs += [(n, sum(r[comm][1][n].float() for r in results), one_grads[n].float(), ref)
                  for n, ref in exact_grads.items()]
        for name, got, one_rank, exact in pairs:
            err, bound = (got - exact).abs().max().item(), 2 * (one_rank - exact).abs().max().item() + 1e-6
            assert err <= bound, f"{comm} {name}: bf16 cp 2 error {err:.3g} > {bound:.3g}"
