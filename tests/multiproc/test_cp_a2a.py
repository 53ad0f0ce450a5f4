"""All-to-all context parallelism (a2a, a2a+p2p; core/context_parallel/ulysses.py) in the LLaMA model on gloo
ranks against the single-rank model: per-token losses (unsharded) and parameter gradients summed over the CP
ranks equal one process's (fp32, rel 1e-5), with GQA, with packed documents (block-causal mask over the
gathered sequence), with the weight gradients deferred to W, at cp 2 (a2a), cp 4 = 2 x 2 (a2a+p2p: a2a over
consecutive CP ranks, the ring over the other level) and cp 2 x tp 2 with sequence parallelism.
"""
import pytest
import torch

from llamapipe.core.context_parallel import unshard_sequence
from llamapipe.core.tensor_parallel.layers import allreduce_sequence_parallel_grads, gather_logical_tensor
from llamapipe.core.tensor_parallel.weight_grad_store import WeightGradStore
from llamapipe.model.llama import LlamaModel
from tests.harness import run_distributed
from tests.multiproc.test_cp_model import CONFIG, B, S, _batch

pytestmark = pytest.mark.slow
# (name, comm type, a2a size at a2a+p2p, config changes, packed documents, deferred weight grads)
CP2 = [("a2a", "a2a", None, {}, False, False), ("a2a docs", "a2a", None, {}, True, False),
       ("a2a mha B/W split", "a2a", None, dict(num_query_groups=8), False, True)]
CP4 = [("a2a+p2p", "a2a+p2p", 2, {}, False, False), ("a2a+p2p docs", "a2a+p2p", 2, {}, True, False),
       ("a2a cp4", "a2a", None, {}, True, False)]


def _documents() -> torch.Tensor:
    """Document ids (b, s): several documents per sample, boundaries not on chunk edges."""
    ids = torch.zeros(B, S, dtype=torch.long)
    ids[0, 5:], ids[0, 11:] = 1, 2
    ids[1, 9:] = 1
    return ids


def _step(model: LlamaModel, tp_group, documents: bool, deferred: bool) -> tuple[torch.Tensor, dict]:
    batch, store = _batch(), WeightGradStore()
    with store.active():
        losses = model(batch["tokens"], labels=batch["labels"], document_ids=_documents() if documents else None)
    loss = (losses * model.sequence_shard(batch["loss_mask"])).sum() / (B * S)
    with store.capture("mb") if deferred else store.active():
        loss.backward()
    if deferred:
        store.run("mb")
    allreduce_sequence_parallel_grads(model, tp_group)
    grads = {n: gather_logical_tensor(p.grad, p, tp_group) for n, p in model.named_parameters()}
    grads["output.weight"] = grads["output.weight"][:CONFIG.vocab_size]
    return losses.detach(), grads


def _worker(rank: int, world_size: int, tp: int, cases: list, sequence_parallel: bool) -> dict:
    from llamapipe.core.parallel_state import initialize_model_parallel
    state = initialize_model_parallel(tp=tp, cp=world_size // tp)
    out = {"cp_rank": state.cp_rank, "tp_rank": state.tp_rank}
    for name, comm, a2a_size, changes, documents, deferred in cases:
        model = LlamaModel(CONFIG.replace(**changes), state, cp_comm_type=comm, cp_a2a_size=a2a_size,
                           sequence_parallel=sequence_parallel)
        out[name] = _step(model, state.tp_group, documents, deferred)
    return out


def _check(tp: int, cp: int, cases: list, sequence_parallel: bool = False) -> None:
    results = run_distributed(_worker, tp * cp, tp, cases, sequence_parallel, timeout=300)
    by_cp = sorted((r for r in results if r["tp_rank"] == 0), key=lambda r: r["cp_rank"])
    for name, _, _, changes, documents, _ in cases:
        ref_losses, ref_grads = _step(LlamaModel(CONFIG.replace(**changes)), None, documents, False)
        case = f"cp={cp} tp={tp} sp={sequence_parallel} {name}"
        torch.testing.assert_close(unshard_sequence([r[name][0] for r in by_cp], dim=1), ref_losses,
                                   rtol=1e-5, atol=1e-6, msg=case)
        for param, ref in ref_grads.items():
            torch.testing.assert_close(sum(r[name][1][param] for r in by_cp), ref, rtol=1e-5, atol=1e-7,
                                       msg=f"{case} {param}")


def test_a2a_cp2_matches_single_rank():
    """a2a at cp 2: GQA, packed documents, MHA with the B/W split."""
    _check(1, 2, CP2)


def test_a2a_p2p_cp4_matches_single_rank():
    """a2a+p2p at cp 4 = 2 x 2 (and plain a2a at cp 4), with packed documents."""
    _check(1, 4, CP4)


def test_a2a_cp2_tp2_sequence_parallel_matches_single_rank():
    """a2a at cp 2 x tp 2 with sequence parallelism: 4 query heads, 2 groups per TP rank."""
    _check(2, 2, CP2[:2], sequence_parallel=True)
