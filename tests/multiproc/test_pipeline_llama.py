"""Every schedule family on the real LlamaModel (tiny, fp32, gloo) equals the single-rank run.

3 SGD steps: per-step token-averaged loss (rel 1e-5) and the first step's gradients, gathered over TP
into full logical tensors, equal one process running the whole model; zero-bubble equals 1F1B.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from llamapipe.core.tensor_parallel.layers import allreduce_sequence_parallel_grads
from llamapipe.model.llama import LlamaConfig
from tests.harness import run_distributed

CONFIG = LlamaConfig(num_layers=8, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2,
                     vocab_size=256, max_position_embeddings=64)
BATCH, SEQ, STEPS, LR = 2, 16, 3, 0.05


def _batches(m: int, step: int, dp_rank: int, documents: bool = False) -> list[dict]:
    """`documents`: packed samples, several documents each (boundaries off the pieces' and CP chunks' edges)."""
    g = torch.Generator().manual_seed(7919 * step + dp_rank)
    batches = [{"tokens": torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g),
                "labels": torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g)} for _ in range(m)]
    if documents:
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        ids[0, 5:], ids[0, 11:], ids[1, 9:] = 1, 2, 1
        for batch in batches:
            batch["document_ids"] = ids
    return batches


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(input_ids=batch["tokens"], labels=batch["labels"], document_ids=batch.get("document_ids"))
    return out, lambda per_token: (per_token.float().sum(), torch.tensor(per_token.numel()), {})


def _full_grad(param: torch.nn.Parameter, ps) -> torch.Tensor:
    import torch.distributed as dist
    if ps.tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.grad
    parts = [torch.empty_like(param.grad) for _ in range(ps.tp_size)]
    dist.all_gather(parts, param.grad.contiguous(), group=ps.tp_group)
    return torch.cat(parts, dim=param.partition_dim)


def _sgd_steps(chunks: list, fb, ps, m: int, documents: bool = False) -> tuple[list[float], dict]:
    import torch.distributed as dist
    tokens, losses, first = m * ps.dp_size * BATCH * SEQ, [], None
    for step in range(STEPS):
        batches = _batches(m, step, ps.dp_rank, documents)
        out = fb(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                 num_microbatches=m)
        total = torch.tensor([sum(float(o["loss_sum"]) for o in out)], dtype=torch.float64)
        for group, size in ((ps.pp_group, ps.pp_size), (ps.dp_group, ps.dp_size), (ps.cp_group, ps.cp_size)):
            if size > 1:
                dist.all_reduce(total, group=group)
        losses.append(float(total) / tokens)
        allreduce_sequence_parallel_grads(chunks, ps.tp_group)     # norms on sequence shards: partial over TP
        params = {n: p for c in chunks for n, p in c.named_parameters()}
        for p in params.values():
            p.grad /= tokens
            for group, size in ((ps.dp_group, ps.dp_size), (ps.cp_group, ps.cp_size)):    # each rank's tokens'
                if size > 1:
                    dist.all_reduce(p.grad, group=group)
        if first is None:
            first = {n: _full_grad(p, ps).numpy().copy() for n, p in params.items()}
        with torch.no_grad():
            for p in params.values():
                p -= LR * p.grad
                p.grad = None
    return losses, first


def llama_chunks(ps, schedule: str, pp: int, vpp: int, **model_kw) -> list:
    """This rank's LlamaModel chunks of CONFIG under the schedule's placement, an even layer split (`model_kw`:
    more LlamaModel arguments)."""
    from llamapipe.core.pipeline_parallel.schedule_ir import stage_of
    from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
    from llamapipe.model.llama import LlamaModel
    placement, stages = SPECS[schedule].placement(vpp), pp * vpp
    per = CONFIG.num_layers // stages
    return [LlamaModel(CONFIG, ps, layer_range=(s * per, (s + 1) * per), pre_process=s == 0,
                       post_process=s == stages - 1, **model_kw)
            for s in (stage_of(ps.pp_rank, c, pp, placement) for c in range(vpp))]


def llama_worker(rank: int, world: int, tp: int, pp: int, cases: list) -> dict:
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    ps0 = initialize_model_parallel(tp, pp)
    out = {}
    try:
        for schedule, vpp, m in cases:
            ps = dataclasses.replace(ps0, vpp_size=vpp)
            chunks = llama_chunks(ps, schedule, pp, vpp)
            fb = get_forward_backward_func(ps, schedule, options=RuntimeOptions(profile_iters=1))
            out[(schedule, vpp, m)] = _sgd_steps(chunks, fb, ps, m)
    finally:
        destroy_model_parallel()
    return out


def assert_match_single_rank(results: list[dict], cases: list, dp: int, documents: bool = False) -> None:
    """Every rank's losses, and the union of their gradients, equal the single-rank run's (rel 1e-5)."""
    for case in cases:
        ref_losses, ref_grads = _single_rank(case[2], dp, documents)
        for r in results:
            torch.testing.assert_close(torch.tensor(r[case][0]), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                       msg=f"{case}: loss differs from the single-rank run")
        grads = {n: torch.from_numpy(g) for r in results for n, g in r[case][1].items()}
        assert set(grads) == set(ref_grads)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=f"{case} {name}")


def _single_rank(m: int, dp: int, documents: bool = False) -> tuple[list[float], dict]:
    from llamapipe.model.llama import LlamaModel
    model = LlamaModel(CONFIG)
    losses, first = [], None
    for step in range(STEPS):
        total = 0.0
        for dp_rank in range(dp):
            for batch in _batches(m, step, dp_rank, documents):
                loss = model(input_ids=batch["tokens"], labels=batch["labels"],
                             document_ids=batch.get("document_ids")).float().sum()
                loss.backward()
                total += float(loss.detach())
        tokens = m * dp * BATCH * SEQ
        losses.append(total / tokens)
        first = first or {n: p.grad / tokens for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad / tokens
                p.grad = None
    return losses, first


LAYOUTS = {  # (tp, pp, dp): [(schedule, vpp, m)]
    (1, 2, 1): [("1f1b", 1, 4), ("zb-h1", 1, 4), ("zbv", 2, 4), ("interleaved", 2, 4)],
    (2, 2, 1): [("1f1b", 1, 3), ("zb-h2", 1, 3)],
}


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", list(LAYOUTS))
def test_llama_schedules_match_single_rank(tp, pp, dp):
    cases = LAYOUTS[(tp, pp, dp)]
    results = run_distributed(llama_worker, tp * pp * dp, tp, pp, cases, timeout=240)
    assert_match_single_rank(results, cases, dp)
    for case in cases:
        if case[0].startswith("zb") and case[1] == 1:
            grads = {n: torch.from_numpy(g) for r in results for n, g in r[case][1].items()}
            base = {n: torch.from_numpy(g) for r in results for n, g in r[("1f1b", 1, case[2])][1].items()}
            for name, g in base.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=0, msg=f"{case} vs 1F1B {name}")
