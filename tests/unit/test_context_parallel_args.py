"""--context-parallel-size and --cp-comm-type through the argument parser: the layout they give (dp is what tp x
cp x pp leave; the rank order gains cp after tp), each bad combination as one sentence naming the flags and
numbers (a2a's query groups per rank, a2a+p2p's levels), Megatron's dynamic CP flags refused, the notices at cp 1, the start-up block,
and the memory check and planner dividing the sequence by cp."""
import pytest

from llamapipe.core.config import ArgumentError
from llamapipe.training.arguments.parser import build_parser, config_from_args
from llamapipe.training.startup import startup_lines

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--max-position-embeddings", "64", "--seq-length", "32", "--vocab-size", "128"]


def cfg(argv, world=1):
    return config_from_args(build_parser().parse_args(BASE + argv), world)


def rejects(argv, world, message):
    with pytest.raises(ArgumentError) as info:
        cfg(argv, world)
    assert str(info.value) == message


def test_cp_takes_its_ranks_from_the_world_and_the_order_gains_cp_after_tp():
    par = cfg(["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"], 8).parallel
    assert (par.tp_size, par.cp_size, par.dp_size, par.pp_size) == (2, 2, 2, 1)
    assert par.sizes == {"tp": 2, "cp": 2, "dp": 2, "pp": 1}
    assert (par.order, par.cp_comm_type) == ("tp-cp-dp-pp", "p2p")
    assert cfg(["--parallel-order", "tp-dp-pp"], 2).parallel.order == "tp-cp-dp-pp"     # an older order string
    assert cfg(["--parallel-order", "dp-pp-tp"], 2).parallel.order == "dp-pp-tp-cp"
    assert cfg(["--context-parallel-size", "2", "--cp-comm-type", "allgather", "allgather"], 2
               ).parallel.cp_comm_type == "allgather"


@pytest.mark.parametrize("argv,world,message", [
    (["--context-parallel-size", "3"], 4, "world size 4 is not divisible by --tensor-model-parallel-size (1) x "
     "--context-parallel-size (3) x --pipeline-model-parallel-size (1)"),
    (["--context-parallel-size", "0"], 4, "--context-parallel-size 0 must be positive"),
    (["--context-parallel-size", "4", "--seq-length", "36"], 4, "--seq-length 36 is not divisible by 2 x "
     "--context-parallel-size (4): context parallelism splits each sequence into 2 equal chunks per rank"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--num-query-groups", "4",
      "--sequence-parallel", "--seq-length", "36"], 8, "--seq-length 36 / --context-parallel-size (2) = 18 tokens per "
     "rank are not divisible by --tensor-model-parallel-size (4) under --sequence-parallel, which splits them over "
     "the tensor-parallel ranks"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--group-query-attention", "--num-query-groups", "2"],
     4, "--cp-comm-type a2a: --num-query-groups 2 / --tensor-model-parallel-size (1) = 2 query groups per rank are "
     "not divisible by the all-to-all size (--context-parallel-size, 4)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "1",
      "--group-query-attention", "--num-query-groups", "2"], 4, "--cp-comm-type a2a+p2p: --num-query-groups 2 / "
     "--tensor-model-parallel-size (1) = 2 query groups per rank are not divisible by the all-to-all size (the first "
     "of --hierarchical-context-parallel-sizes, 4)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 2, "--cp-comm-type a2a+p2p needs "
     "--hierarchical-context-parallel-sizes A P (the all-to-all and ring levels) with A x P = --context-parallel-size "
     "(2); got none"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "4"],
     4, "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (the all-to-all and ring levels) with "
     "A x P = --context-parallel-size (4); got 2 4"),
    (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"], 4,
     "--hierarchical-context-parallel-sizes 2 2 is for --cp-comm-type a2a+p2p, not p2p"),
    (["--context-parallel-size", "2", "--cp-comm-type", "ring"], 2, "--cp-comm-type ring is not one of p2p, "
     "allgather, a2a, a2a+p2p"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "allgather"], 2, "--cp-comm-type p2p allgather "
     "gives layers different communication types, which is not supported; give one"),
    (["--parallel-order", "tp-cp-cp-dp-pp"], 2, "--parallel-order tp-cp-cp-dp-pp must name tp, dp and pp once each, "
     "and may name cp once, e.g. tp-cp-dp-pp or tp-dp-pp"),
    (["--parallel-order", "tp-cp-pp"], 2, "--parallel-order tp-cp-pp must name tp, dp and pp once each, and may name "
     "cp once, e.g. tp-cp-dp-pp or tp-dp-pp"),
])
def test_bad_context_parallel_combinations_are_one_sentence(argv, world, message):
    rejects(argv, world, message)


def test_sequence_parallel_needs_only_the_local_tokens_to_split_over_tp():
    """36 tokens at cp 2: 9-token chunks, 18 per rank, 9 per tensor-parallel rank under sp (runs: the chunks
    need not align with the tp split)."""
    par = cfg(["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--seq-length", "36"], 4).parallel
    assert (par.cp_size, par.tp_size, par.sequence_parallel) == (2, 2, True)


def test_a2a_and_a2a_p2p_give_their_all_to_all_size():
    """a2a: heads over the whole CP group; a2a+p2p: over Megatron's first hierarchical level."""
    par = cfg(["--context-parallel-size", "2", "--cp-comm-type", "a2a"], 2).parallel
    assert (par.cp_comm_type, par.cp_a2a_size) == ("a2a", None)
    par = cfg(["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
               "2", "2"], 4).parallel
    assert (par.cp_comm_type, par.cp_a2a_size) == ("a2a+p2p", 2)


@pytest.mark.parametrize("argv", [["--dynamic-context-parallel"], ["--hybrid-context-parallel"],
                                  ["--min-dynamic-context-parallel-size", "1"]])
def test_dynamic_cp_is_refused_by_name(argv):
    with pytest.raises(ArgumentError, match=f"^{argv[0]} .*is not supported: "):
        cfg(argv, 2)


def test_notices_at_cp_1_and_zero_sharding_is_active_over_cp(llamapipe_log):
    cfg(["--cp-comm-type", "allgather", "--max-seqlen-per-dp-cp-rank", "64"], 1)
    assert "notice: --cp-comm-type allgather has no effect with --context-parallel-size 1: each rank holds whole " \
           "sequences" in llamapipe_log
    assert any(line.startswith("notice: --max-seqlen-per-dp-cp-rank 64 has no effect here") for line in llamapipe_log)
    llamapipe_log.clear()
    cfg(["--context-parallel-size", "2", "--use-distributed-optimizer"], 2)     # dp 1, but 2 replicas to shard over
    assert not [line for line in llamapipe_log if "has no effect" in line]


def test_startup_block_says_cp_and_its_comm_type():
    lines = startup_lines(cfg(["--context-parallel-size", "2", "--cp-comm-type", "allgather",
                               "--use-distributed-optimizer"], 4))
    assert lines[0] == ("run: 4 ranks = tp 1 x cp 2 (context parallel, allgather attention: each rank holds 16 of "
                        "every 32 tokens) x pp 1 x dp 2 (order tp-cp-dp-pp), sequence parallel off, gloo")
    assert "gradients reduced over dp x cp (4 replicas) after the backward" in lines[2]


def test_memory_check_divides_the_logits_by_cp():
    from llamapipe.training.arguments.memory import check_fits_memory
    config = cfg(["--context-parallel-size", "4", "--micro-batch-size", "2", "--seq-length", "4096",
                  "--max-position-embeddings", "4096", "--vocab-size", "32000"], 4)
    logits = 2 * 4096 // 4 * config.model.padded_vocab_size(1) * 4      # micro x seq / cp x vocabulary, fp32
    check_fits_memory(config.model, config.parallel, config.training, False, logits)
    with pytest.raises(ArgumentError, match=r"--seq-length 4096 / cp 4 x vocabulary 32000"):
        check_fits_memory(config.model, config.parallel, config.training, False, logits - 1)


def test_planner_divides_activations_and_compute_by_cp_and_adds_the_kv_traffic():
    from llamapipe.model.llama import LlamaConfig
    from llamapipe.tools.parallel_estimate import DEVICES, Layout, context_parallel_seconds, estimate, rank_memory
    model = LlamaConfig(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
                        num_query_groups=4, vocab_size=32000, max_position_embeddings=32768)
    seq, dev = 32768, DEVICES["h100"]
    base = dict(tp=1, pp=1, vpp=1, dp=1, schedule="1f1b", micro_batch=1, recompute="none", dist_opt=True)
    one, = rank_memory(model, Layout(**base), seq, 1)
    for cp in (2, 4):
        mem, = rank_memory(model, Layout(**base, cp=cp), seq, 1)
        assert mem.activations == pytest.approx(one.activations / cp, rel=1e-12)
        assert mem.optimizer == pytest.approx(one.optimizer / cp, rel=1e-12)    # ZeRO-1 over dp x cp
    ring, gather = (Layout(**base, cp=4, cp_comm=c) for c in ("p2p", "allgather"))
    # 32k tokens: the ring's transfers hide behind the attention blocks; the all-gather's do not
    assert context_parallel_seconds(model, ring, seq, dev) == 0.0
    kv = seq / 4 * 2 * 4 * 64 * 2                                   # bytes of one rank's K/V per layer
    assert context_parallel_seconds(model, gather, seq, dev) == pytest.approx(4 * 3 * 3 * kv * 8 / 3600e9)
    t1, t4 = estimate(model, Layout(**base), seq, 1, dev).step_s, estimate(model, ring, seq, 1, dev).step_s
    grads = 4 * one.params / 2                                      # fp32 gradients of the bf16 weights
    assert t4 == pytest.approx(t1 / 4 + 2 * 3 / 4 * grads * 8 / 3600e9, rel=1e-9)    # + their all-reduce over cp


def test_flash_attention_flag_under_context_parallelism_is_a_notice():
    from llamapipe.training.arguments.noop import noop_notices
    args = build_parser().parse_args(BASE + ["--context-parallel-size", "2", "--use-flash-attn"])
    notes = noop_notices(args, cfg(["--context-parallel-size", "2"], 2).parallel)
    assert any(n.startswith("notice: --use-flash-attn has no effect with --context-parallel-size 2") for n in notes)
