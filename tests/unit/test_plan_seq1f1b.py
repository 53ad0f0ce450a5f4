"""`llamapipe plan` with Seq1F1B (--num-seq-splits) and a2a+p2p rows (issue 45): the pieces' memory against the
runtime's cut and an independent replay of the plan, the walk against the simulator's, the step time against the
simulator's makespans, a2a+p2p's messages against its two limits and a hand count, the candidates against the dry
run's own checks, and the LLaMA-3.1-8B / 131,072-token / 64-GPU plan whose top row (and best Seq1F1B row) pass
the dry run. The memory against the dry run's measured shards: tests/unit/test_dry_run_plan.py."""
import pytest

from llamapipe.core.pipeline_parallel.seq_split import SeqSplits
from llamapipe.core.pipeline_parallel.simulator import Costs, peak_memory, simulate
from llamapipe.model.llama import LlamaConfig
from llamapipe.model.families import PRESETS
from llamapipe.tools.parallel_estimate import (DEVICES, Layout, a2a_seconds, chunk_act_bytes, context_parallel_seconds,
                                               estimate, layer_act_bytes, piece_lengths, plan_peaks, rank_memory,
                                               seq_plan, verified_plan)
from llamapipe.tools.plan_candidates import _dry_run_parser, layouts, refusal, trainer_flags
from llamapipe.tools.plan_parallelism import build_parser, checked, dry_run_command, main, model_from_args, rank
from llamapipe.training.dry_run.main import dry_run_config, main as dry_run_main

SEQ, H100 = 131072, DEVICES["h100"]
M8B = LlamaConfig(**PRESETS["llama3.1-8b"])


def test_pieces_are_the_runtimes_cut_and_their_bytes_add_up_to_the_microbatch():
    """The planner's pieces are training/setup.py's (equal FLOPs, tp-aligned); their layer bytes sum to the unsplit
    microbatch's plus the key/value gradients of all but the last piece (and nothing else without recompute)."""
    for k in (2, 4, 8):
        lay = Layout(8, 4, 1, 2, "1f1b", 1, "none", False, seq_splits=k)
        lengths = piece_lengths(M8B, lay, SEQ)
        bounds = SeqSplits.for_model(k, "flops", M8B.hidden_size, M8B.ffn_hidden_size, M8B.num_attention_heads,
                                     M8B.head_dim, M8B.num_query_groups, align=8).bounds(SEQ)
        assert lengths == tuple(b - a for a, b in zip(bounds, bounds[1:])) and sum(lengths) == SEQ
        assert all(x % 8 == 0 for x in lengths) and list(lengths) == sorted(lengths, reverse=True)
        plain = chunk_act_bytes(M8B, Layout(8, 4, 1, 2, "1f1b", 1, "none", False), SEQ)[0][0][0]
        split = sum(saved for saved, _ in chunk_act_bytes(M8B, lay, SEQ)[0])
        kv_grads = 8 * (SEQ - lengths[-1]) * 2 * 2 * M8B.num_query_groups * M8B.head_dim / 8   # 8 layers a stage
        assert split == pytest.approx(plain + kv_grads, rel=1e-12)


def test_pieces_under_context_parallelism_are_the_runtimes_cut_of_the_whole_sequence():
    """Under CP the runtime cuts the whole sequence into pieces (equal FLOPs over all 131,072 causal tokens, so the
    first piece is long) and shares each piece among the cp ranks: the planner's per-rank pieces are those over cp,
    not a cut of one rank's 16,384 tokens (which gave 9% less activation memory than the dry run at K 8)."""
    from llamapipe.training.arguments.parser import build_parser as trainer_parser, config_from_args
    from llamapipe.training.setup import seq_splits
    for k, tp in ((4, 1), (8, 2)):
        argv = (f"--mock-data --model llama3.1-8b --seq-length {SEQ} --context-parallel-size 8 --num-seq-splits {k} "
                f"--tensor-model-parallel-size {tp} --global-batch-size 8").split()
        argv += ["--sequence-parallel"] if tp > 1 else []
        runtime = seq_splits(config_from_args(trainer_parser().parse_args(argv), 8 * tp)).bounds(SEQ)
        lengths = piece_lengths(M8B, Layout(tp, 1, 1, 1, "1f1b", 1, "none", False, cp=8, seq_splits=k), SEQ)
        assert lengths == tuple((b - a) // 8 for a, b in zip(runtime, runtime[1:])), (k, tp)
        assert lengths[0] > 1.5 * SEQ // 8 // k      # the first piece holds far more than 1/K of the tokens


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("zb-h1", 1), ("zbv", 2), ("interleaved", 2)])
def test_walk_of_pieces_equals_the_simulators_peak(schedule, vpp):
    """Equal pieces of 1/K of a microbatch (M_W half of M_B): the planner's walk of the Seq1F1B plan, with entry
    chunk x K + piece, gives the simulator's own peak for `Costs.pieces(K)`."""
    for k in (2, 4):
        plan = seq_plan(schedule, 4, vpp, 8, k)
        per_rank = [[(1.0 / k, 0.5 / k)] * (vpp * k)] * 4
        assert plan_peaks(plan, per_rank) == pytest.approx(peak_memory(plan, Costs().pieces(k)), rel=1e-12)


def _replay_peak(plan, rank: int, unit_bytes) -> float:
    """A rank's activation peak by hand: F keeps its piece's bytes until that piece's BW frees them."""
    live, peak = {}, 0.0
    for a in plan.actions[rank]:
        if a.kind == "F":
            live[a.microbatch] = unit_bytes[a.microbatch % plan.seq_splits]
        else:
            live.pop(a.microbatch)
        peak = max(peak, sum(live.values()))
    return peak


def test_activations_fall_with_k_as_a_replay_of_the_plan_says():
    """LLaMA-3.1-8B at 131,072 tokens, tp 8 x pp 4, 1F1B: the first rank's peak is the replay of the Seq1F1B plan
    with each piece's layer bytes (and key/value gradients); it falls with K (K = 1 is the plain row)."""
    peaks = []
    for k in (1, 2, 4, 8):
        lay = Layout(8, 4, 1, 2, "1f1b", 1, "none", False, seq_splits=k)
        lengths = piece_lengths(M8B, lay, SEQ)
        kv = 2 * 2 * M8B.num_query_groups * M8B.head_dim / 8
        unit = [8 * (layer_act_bytes(M8B, n, 1, "none", "bf16", 8)[0] + (n * kv if i < k - 1 else 0))
                for i, n in enumerate(lengths)]
        plan = seq_plan("1f1b", 4, 1, 8, k) if k > 1 else verified_plan("1f1b", 4, 1, 8)
        first = rank_memory(M8B, lay, SEQ, 16)[0].activations
        assert first == pytest.approx(_replay_peak(plan, 0, unit), rel=1e-12)
        peaks.append(first)
    assert peaks == sorted(peaks, reverse=True)
    # K = 4: the rank holds pp - 2 + K = 6 pieces, a whole microbatch and the next one's first two, where 1F1B holds
    # pp = 4 microbatches; equal pieces would give 6 / 16, but equal-FLOPs pieces start long (42% of the tokens)
    assert 6 / 16 < peaks[2] / peaks[0] < 0.6


def test_step_time_follows_the_simulated_pieces():
    """With one microbatch per pipeline rank the bubble dominates: Seq1F1B's step over the plain one is the
    simulator's makespan of the pieces' plan (costs / K) over the plain plan's, within the small TP and p2p terms."""
    plain = Layout(8, 8, 1, 1, "1f1b", 1, "none", False)
    base = estimate(M8B, plain, SEQ, 8, H100).step_s
    reference = simulate(verified_plan("1f1b", 8, 1, 8), Costs()).makespan
    for k in (2, 4, 8):
        lay = Layout(8, 8, 1, 1, "1f1b", 1, "none", False, seq_splits=k)
        ratio = simulate(seq_plan("1f1b", 8, 1, 8, k), Costs().pieces(k)).makespan / reference
        assert ratio < 1
        assert estimate(M8B, lay, SEQ, 8, H100).step_s / base == pytest.approx(ratio, rel=0.03)


def test_a2a_p2p_messages_between_its_limits_and_by_hand():
    """a2a+p2p at A x P: A = cp is a2a, A = 1 the ring; 2 x 4 at tp 1, cp 8 over 64 GPUs: the all-to-alls of 2
    ranks (q, k, v, out of 16,384 tokens, half of them leaving, F and B) on NVLink, the ring's 3 of K/V per step
    over 3 steps within a node, hidden by attention."""
    ring = Layout(1, 4, 1, 2, "1f1b", 1, "none", False, cp=8)
    a2a = Layout(1, 4, 1, 2, "1f1b", 1, "none", False, cp=8, cp_comm="a2a")
    for level, same in ((8, a2a), (1, ring)):
        lay = Layout(1, 4, 1, 2, "1f1b", 1, "none", False, cp=8, cp_comm="a2a+p2p", cp_a2a=level)
        assert context_parallel_seconds(M8B, lay, SEQ, H100) == pytest.approx(
            context_parallel_seconds(M8B, same, SEQ, H100), rel=1e-12)
    lay = Layout(1, 4, 1, 2, "1f1b", 1, "none", False, cp=8, cp_comm="a2a+p2p", cp_a2a=2)
    width = (2 * 32 + 2 * 8) * 128                                   # q and out (32 heads), k and v (8 groups)
    by_hand = 8 * 2 * (16384 * width * 2 / 2) * 8 / 3600e9           # 8 layers a chunk, F + B, bytes x 8 bits
    assert a2a_seconds(M8B, lay, SEQ, H100, 2) == pytest.approx(by_hand, rel=1e-12)
    assert context_parallel_seconds(M8B, lay, SEQ, H100) == pytest.approx(by_hand, rel=1e-12)   # ring hidden
    assert rank_memory(M8B, lay, SEQ, 16)[0].comm == rank_memory(M8B, a2a, SEQ, 16)[0].comm     # one a2a buffer


def test_seq1f1b_ring_and_allgather_resend_the_earlier_pieces():
    """Under the ring and the all-gather each piece's message carries the earlier pieces' shards
    (core/context_parallel/ring_pieces.py, pieces.py): K/V bytes x the sum of the pieces' ends over the tokens,
    above (K + 1) / 2 for FLOPs-balanced pieces (they start long); a2a sends each piece once."""
    for k in (2, 4):
        # the runtime's pieces: the whole sequence cut by FLOPs into multiples of the 2 x cp chunks, each piece
        # then shared by the 8 CP ranks
        bounds = SeqSplits.for_model(k, "flops", M8B.hidden_size, M8B.ffn_hidden_size, M8B.num_attention_heads,
                                     M8B.head_dim, M8B.num_query_groups, align=2 * 8).bounds(SEQ)
        resent = sum(bounds[1:]) / SEQ
        assert resent > (k + 1) / 2
        for comm in ("allgather", "a2a"):
            plain = Layout(1, 4, 1, 2, "1f1b", 1, "none", False, cp=8, cp_comm=comm)
            split = Layout(1, 4, 1, 2, "1f1b", 1, "none", False, cp=8, cp_comm=comm, seq_splits=k)
            ratio = context_parallel_seconds(M8B, split, SEQ, H100) / context_parallel_seconds(M8B, plain, SEQ, H100)
            assert ratio == pytest.approx(resent if comm == "allgather" else 1.0, rel=1e-12), comm


def test_candidates_and_the_dry_runs_checks_agree():
    """Seq1F1B rows for the schedules with a Seq1F1B builder, K dividing each CP rank's tokens; a2a+p2p levels
    that divide the query groups per tp rank; every candidate's verdict is the dry run's own on its flags."""
    args = build_parser().parse_args("--model llama3.1-8b --gpus 16 --global-batch-size 16 --seq-length 8192 "
                                     "--max-context-parallel-size 4".split())
    found = layouts(M8B, 16, 16, 1, 4, 8192, (2, 4, 3))
    seq = [lay for lay in found if lay.seq_splits > 1]
    assert {lay.schedule for lay in seq} == {"1f1b", "zb-h1", "zbv", "interleaved"}
    assert {lay.seq_splits for lay in seq} == {2, 4} and all(lay.pp > 1 and lay.vpp <= 2 for lay in seq)
    hier = {(lay.tp, lay.cp, lay.cp_a2a) for lay in found if lay.cp_comm == "a2a+p2p"}
    assert hier == {(1, 4, 2), (2, 4, 2), (4, 4, 2)}     # 8 query groups: tp 8 leaves 1 a rank, no a2a level
    picks = [next(lay for lay in seq if lay.cp > 1), next(lay for lay in seq if lay.cp == 1),
             next(lay for lay in found if lay.cp_comm == "a2a+p2p")]
    for lay in picks:
        argv = ["--world-size", "16", "--gpu-memory-gb", "80"] + " ".join(trainer_flags(args, lay, M8B)).split()
        try:
            dry_run_config(_dry_run_parser().parse_args(argv))
            expected = None
        except ValueError as err:
            expected = str(err)
        assert refusal(args, lay, M8B) == expected, lay


def test_a_piece_count_below_one_is_one_line(capsys):
    assert main("--model llama3.1-8b --gpus 8 --global-batch-size 8 --num-seq-splits 4 0".split()) == 2
    assert capsys.readouterr().err == "llamapipe plan: --num-seq-splits takes piece counts of at least 1, got 4 0\n"


@pytest.mark.slow       # the plan (4 s) and the dry runs of its top row (12 s) and best Seq1F1B row (8 s)
def test_llama3_8b_at_131k_tokens_on_64_gpus_ranks_ring_a2a_and_seq1f1b_and_its_rows_pass_the_dry_run(capsys):
    argv = ("--model llama3.1-8b --gpus 64 --seq-length 131072 --global-batch-size 8 --max-context-parallel-size 8 "
            "--max-micro-batch-size 1 --num-seq-splits 4 --top 3").split()
    assert main(argv) == 0
    out = capsys.readouterr().out
    for option in ("ring context parallelism", "a2a context parallelism", "a2a+p2p context parallelism",
                   "Seq1F1B (--num-seq-splits)"):
        assert f"best {option}: row " in out, option
    args = build_parser().parse_args(argv)
    m = model_from_args(args)
    rows = checked(rank(m, args, H100), args, m, args.top)
    seq_row = next(lay for lay, _ in rows if lay.seq_splits > 1)
    assert dry_run_command(args, rows[0][0], m) in out
    for lay in dict.fromkeys((rows[0][0], seq_row)):     # once when the top row is itself the best Seq1F1B row
        command = dry_run_command(args, lay, m).split()[2:]
        assert dry_run_main(command) == 0, command
    assert "--num-seq-splits 4" in dry_run_command(args, seq_row, m)
