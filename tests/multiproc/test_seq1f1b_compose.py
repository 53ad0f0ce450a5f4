"""Seq1F1B (--num-seq-splits) composed with other parallelism, on the real LlamaModel (tiny, fp32, gloo), in one
launch of 4 ranks: pp 2 x cp 2 (a2a: each piece cut into the 2 x cp load-balanced chunks, gathered whole per head
group where it meets the earlier pieces' cached keys) under 1F1B with uneven pieces, ZB-V, and ZB-H1 with packed
documents (a piece attends within its documents over the gathered sequence), allgather under ZB-V, the ring (p2p,
Megatron's default: the piece's and the earlier pieces' shards round the ring) under ZB-V with uneven pieces and
packed documents and under 1F1B, pp 1 x cp 4 with a2a+p2p 2 x 2 (1F1B, packed documents), and pp 2 x tp 2 with
sequence parallelism under ZB-V. 3 SGD steps give the single-rank run's per-step losses (rel 1e-5) and first-step
gradients."""
from __future__ import annotations

import dataclasses

import pytest

from tests.harness import run_distributed
from tests.multiproc.test_pipeline_llama import CONFIG, _sgd_steps, assert_match_single_rank, llama_chunks

# (layout, schedule, vpp, microbatches, K, uneven pieces, packed documents)
CASES = [("cp2", "1f1b", 1, 4, 2, True, False), ("cp2", "zbv", 2, 4, 2, False, False),
         ("cp2", "zb-h1", 1, 4, 2, True, True), ("cp2-allgather", "zbv", 2, 4, 2, True, True),
         ("tp2-sp", "zbv", 2, 4, 2, False, False), ("cp2-p2p", "zbv", 2, 4, 2, True, True),
         ("cp2-p2p", "1f1b", 1, 4, 2, True, False), ("cp4-a2a+p2p", "1f1b", 1, 2, 2, False, True)]
LAYOUTS = {"cp2": (dict(tp=1, pp=2, cp=2), dict(cp_comm_type="a2a")),
           "cp2-allgather": (dict(tp=1, pp=2, cp=2), dict(cp_comm_type="allgather")),
           "tp2-sp": (dict(tp=2, pp=2), dict(sequence_parallel=True)),
           "cp2-p2p": (dict(tp=1, pp=2, cp=2), dict(cp_comm_type="p2p")),
           "cp4-a2a+p2p": (dict(tp=1, pp=1, cp=4), dict(cp_comm_type="a2a+p2p", cp_a2a_size=2))}


def compose_worker(rank: int, world: int, cases: list) -> dict:
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    from llamapipe.core.pipeline_parallel.seq_split import SeqSplits, piece_align
    out = {}
    for layout in dict.fromkeys(case[0] for case in cases):
        sizes, model_kw = LAYOUTS[layout]
        ps0 = initialize_model_parallel(**sizes)
        align = piece_align(ps0.tp_size, model_kw.get("sequence_parallel", False), ps0.cp_size)
        try:
            for case in (c for c in cases if c[0] == layout):
                _, schedule, vpp, m, k, uneven, documents = case
                ps = dataclasses.replace(ps0, vpp_size=vpp)
                chunks = llama_chunks(ps, schedule, sizes["pp"], vpp, **model_kw)
                splits = (SeqSplits(k, "flops", linear=1.0, pair=1.0, align=align) if uneven else   # 12 + 4 tokens
                          SeqSplits.for_model(k, "flops", CONFIG.hidden_size, CONFIG.ffn_hidden_size,
                                              CONFIG.num_attention_heads, CONFIG.head_dim, CONFIG.num_query_groups,
                                              align=align))
                fb = get_forward_backward_func(ps, schedule, options=RuntimeOptions(seq_splits=splits))
                out[case] = _sgd_steps(chunks, fb, ps, m, documents)
        finally:
            destroy_model_parallel()
    return out


@pytest.mark.slow
def test_seq1f1b_with_cp_and_tp_matches_single_rank() -> None:
    results = run_distributed(compose_worker, 4, CASES, timeout=400)
    for case in CASES:
        assert_match_single_rank([{case[1:4]: r[case]} for r in results], [case[1:4]], 1, documents=case[6])
