"""Seq1F1B (--num-seq-splits) on the real LlamaModel at pp 2 (tiny, fp32, gloo): 3 SGD steps with each microbatch
split into K sequence pieces give the single-rank run's per-step losses (rel 1e-5) and first-step gradients; "uneven"
boundaries (a FLOPs model dominated by attention: pieces of different lengths) too."""
from __future__ import annotations

import dataclasses

import pytest

from tests.harness import run_distributed
from tests.multiproc.test_pipeline_llama import CONFIG, _sgd_steps, assert_match_single_rank, llama_chunks

CASES = [("1f1b", 1, 4, 2), ("1f1b", 1, 4, 4), ("zb-h1", 1, 4, 2), ("zb-h1", 1, 4, 4), ("zbv", 2, 4, 2), ("zbv", 2, 4, 4),
         ("interleaved", 2, 4, 2)]


def seq_worker(rank: int, world: int, cases: list, method: str) -> dict:
    from llamapipe.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from llamapipe.core.pipeline_parallel.runtime import RuntimeOptions
    from llamapipe.core.pipeline_parallel.schedules import get_forward_backward_func
    from llamapipe.core.pipeline_parallel.seq_split import SeqSplits
    ps0 = initialize_model_parallel(1, world)
    out = {}
    try:
        for schedule, vpp, m, k in cases:
            ps = dataclasses.replace(ps0, vpp_size=vpp)
            chunks = llama_chunks(ps, schedule, world, vpp)
            splits = (SeqSplits(k, "flops", linear=1.0, pair=1.0) if method == "uneven" else   # later pieces shorter
                      SeqSplits.for_model(k, method, CONFIG.hidden_size, CONFIG.ffn_hidden_size,
                                          CONFIG.num_attention_heads, CONFIG.head_dim, CONFIG.num_query_groups))
            fb = get_forward_backward_func(ps, schedule, options=RuntimeOptions(seq_splits=splits))
            out[(schedule, vpp, m, k)] = _sgd_steps(chunks, fb, ps, m)
    finally:
        destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["flops", "length", "uneven"])
def test_seq1f1b_matches_single_rank(method: str) -> None:
    cases = CASES if method == "flops" else [CASES[1], CASES[5]]
    results = run_distributed(seq_worker, 2, cases, method, timeout=300)
    for case in cases:
        assert_match_single_rank([{case[:3]: r[case]} for r in results], [case[:3]], 1)
