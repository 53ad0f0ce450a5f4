"""`llamapipe plan` (tools/plan_parallelism.py, tools/parallel_estimate.py): its memory model against Megatron-LM's
published theoretical-memory formula, its ranking, and its top row as a command line the trainer accepts."""
import shlex

import pytest

from llamapipe.model.llama import PRESETS, LlamaConfig
from llamapipe.core.pipeline_parallel.schedule_specs import build
from llamapipe.tools.parallel_estimate import DEVICES, GIB, Layout, estimate, plan_peaks, rank_memory
from llamapipe.tools.plan_parallelism import main
from llamapipe.training.arguments.parser import build_parser, config_from_args

# Megatron-LM megatron/training/theoretical_memory_usage.py (report_theoretical_memory: sequence parallelism and
# selective recompute, 1F1B, untied embeddings; Korthikanti et al., arXiv 2205.05198, Table 2), evaluated by hand
# for LLaMA2-7B (L 32, h 4096, a = g = 32, vocab 32000 padded to 128 x tp), seq 4096, micro-batch 1, 64
# microbatches: weights and optimizer = params of the most loaded shard x (18, or 6 + 12/dp with the distributed
# optimizer); activations = (34 s b h L + 8 s b pp + s b h pp [+ 4 s b h (1 + V/h) when pp = 1]) / tp.
MEGATRON_BYTES = {  # (tp, pp, dp, distributed optimizer): weights + optimizer, activations
    (8, 1, 1, False): (15_100_692_480, 2_359_300_096),
    (4, 2, 1, False): (15_091_255_296, 4_571_807_744),
    (2, 2, 2, True): (20_115_382_272, 9_143_615_488),
}
# What this trainer saves (tests/multiproc/test_planner_memory.py measures it), by hand for the same runs: per
# token and decoder layer (16 h + 2 (2 hd + 2 kv + 4 f) + 8) / tp bytes = 186376 / tp (RMSNorm input and output
# 16 h, q k v and the attention output, SwiGLU's gate, up, silu and product 4 f, fp32 rstd), x 4096 tokens x 32
# layer-microbatches on pp rank 0 (1F1B holds pp microbatches of L / pp layers); at pp 1 the same rank also holds
# the final norm and the fp32 softmax, 4096 (8 h + 4 + 4 x 32768) / 8. Megatron's 18 + 4 f / h per layer is a GPT
# MLP's (two matrices, one GeLU input): SwiGLU keeps 4 s b f, and bf16 RMSNorm keeps its input in fp32.
OWN_ACTIVATIONS = {(8, 1, 1, False): 3_137_472_512, (4, 2, 1, False): 6_107_168_768,
                   (2, 2, 2, True): 12_214_337_536}


@pytest.mark.parametrize("layout", list(MEGATRON_BYTES))
def test_llama2_7b_weights_match_megatrons_formula_and_activations_the_hand_count(layout):
    tp, pp, dp, dist_opt = layout
    model = LlamaConfig(**PRESETS["llama2-7b"])
    est = estimate(model, Layout(tp, pp, 1, dp, "1f1b", 1, "selective", dist_opt), 4096, 64 * dp, DEVICES["h100"])
    weights, megatron_activations = MEGATRON_BYTES[layout]
    assert abs(est.params + est.grads + est.optimizer - weights) <= 0.02 * weights
    assert est.activations == pytest.approx(OWN_ACTIVATIONS[layout], rel=1e-9)
    assert 1.2 < est.activations / megatron_activations < 1.4     # the SwiGLU / fp32-norm difference above


def test_precision_and_zero1_bytes_per_parameter():
    """fp32: 4 (weight) + 4 (grad) + 8 (m, v; the weight is the master); bf16: 2 + 4 + 12; ZeRO-1 divides the
    optimizer's share by dp. Parameters of the tiny model by hand: 8 layers x 36992 + 256 x 64 x 2 + 64."""
    model = LlamaConfig(num_layers=8, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=2, vocab_size=256)
    params = 8 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 2 * 256 * 64 + 64
    for precision, dist_opt, per_param in (("fp32", False, (4, 4, 8)), ("bf16", False, (2, 4, 12)),
                                           ("bf16", True, (2, 4, 6))):
        (rank,) = rank_memory(model, Layout(1, 1, 1, 2, "1f1b", 1, "none", dist_opt, precision), 32, 4)
        assert (rank.params, rank.grads, rank.optimizer) == tuple(params * b for b in per_param), precision


def test_layout_string_moves_parameters_and_activations():
    """'Et|t*7L' puts 1 layer on pp rank 0 and 7 with the head on rank 1: rank 1 holds 7x the layers' weights."""
    model = LlamaConfig(num_layers=8, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=2, vocab_size=256)
    even, uneven = (rank_memory(model, Layout(1, 2, 1, 1, "1f1b", 1, "none", False, "fp32", text), 32, 8)
                    for text in (None, "Et|t*7L"))
    layer, vocab = 4 * 36992, 4 * 256 * 64
    assert (even[0].params, even[1].params) == (4 * layer + vocab, 4 * layer + vocab + 256)
    assert (uneven[0].params, uneven[1].params) == (layer + vocab, 7 * layer + vocab + 256)
    assert uneven[0].activations < even[0].activations and uneven[1].activations > even[1].activations


def test_a_bw_that_sends_holds_its_weight_gradient_inputs_for_a_moment():
    """Two ranks, 1F1B, one microbatch: rank 1's BW runs as B, send, W, so it peaks at max(M_B, M_W)."""
    plan = build("1f1b", 2, 1, 1)
    assert plan_peaks(plan, [[(10.0, 3.0)], [(10.0, 3.0)]]) == [10.0, 10.0]
    assert plan_peaks(plan, [[(1.0, 13.0)], [(1.0, 13.0)]]) == [1.0, 13.0]     # full recompute: W > F


def test_v_schedules_plan_less_activation_memory_than_1f1b():
    model = LlamaConfig(**PRESETS["llama2-7b"])
    act = {s: estimate(model, Layout(1, 8, v, 1, s, 1, "selective", False), 4096, 64, DEVICES["h100"]).activations
           for s, v in (("1f1b", 1), ("v-half", 2), ("v-min", 2))}
    assert act["v-half"] <= 0.7 * act["1f1b"] and act["v-min"] <= 0.5 * act["1f1b"], act


def test_plan_prints_a_ranked_table_and_a_command_the_trainer_accepts(capsys):
    assert main(["--model", "llama2-7b", "--gpus", "8", "--gpu-memory-gb", "80", "--seq-length", "4096",
                 "--global-batch-size", "64", "--top", "5"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit() and "%" in line]
    assert len(rows) == 5
    steps = [float(line.split()[-2]) for line in rows]
    assert steps == sorted(steps)
    assert all(float(line.split()[-3]) <= 0.9 * 80 for line in rows)            # total GiB under the headroom
    cmd = shlex.split(out.split("Top row:")[1].strip())
    assert cmd[:3] == ["torchrun", "--nproc-per-node", "8"] and cmd[3] == "pretrain_llama.py"
    config = config_from_args(build_parser().parse_args(cmd[4:] + ["--mock-data"]), 8)
    assert config.parallel.tp_size * config.parallel.pp_size * config.parallel.dp_size == 8


def test_explain_and_nothing_fits(capsys):
    assert main(["--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64", "--explain", "1"]) == 0
    out = capsys.readouterr().out
    assert "total on the most loaded rank" in out and "optimizer" in out
    assert main(["--model", "llama2-70b", "--gpus", "1", "--gpu-memory-gb", "24", "--global-batch-size", "8"]) == 1
    assert "no layout fits 1 GPUs of 24 GiB" in capsys.readouterr().err
    assert GIB == 2 ** 30


def test_context_parallel_layouts_split_the_sequence_and_print_a_command_the_trainer_accepts(capsys):
    from llamapipe.tools.plan_parallelism import layouts
    m = LlamaConfig.from_name("llama3-8b")
    plain = layouts(m, 16, 16, 1)
    with_cp = layouts(m, 16, 16, 1, max_cp=8, seq_length=65536)
    assert {lay.cp for lay in plain} == {1} and set(plain) <= set(with_cp)
    assert {lay.cp for lay in with_cp} == {1, 2, 4, 8}
    assert all(lay.tp * lay.cp * lay.pp * lay.dp == 16 for lay in with_cp)
    odd = layouts(m, 16, 16, 1, max_cp=8, seq_length=3000)      # 2 x cp chunks of a multiple of tp tokens
    assert 8 not in {lay.cp for lay in odd} and 4 in {lay.cp for lay in odd}
    assert all(3000 % (2 * lay.cp * lay.tp) == 0 for lay in odd if lay.cp > 1)
    # at 64k tokens activations dominate: a split sequence is the only thing that fits 80 GB on 16 GPUs
    assert main(["--model", "llama3-8b", "--gpus", "16", "--gpu-memory-gb", "80", "--seq-length", "65536",
                 "--global-batch-size", "16", "--max-context-parallel-size", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    cmd = shlex.split(out.split("Top row:")[1].strip())
    assert "--context-parallel-size" in cmd
    config = config_from_args(build_parser().parse_args(cmd[cmd.index("scripts/launch_multi_node.sh") + 1:]), 16)
    par = config.parallel
    assert par.cp_size > 1 and par.tp_size * par.cp_size * par.pp_size * par.dp_size == 16


def test_grouped_schedules_are_ranked_by_their_plans():
    """`plan` ranks group-interleaved and 1f1b-v from their plans: the fork's groups of p keep interleaved's step
    time with 1F1B's activations (interleaved holds (2(p-1) + (v-1)p + 1)/v stages), 1F1B-V about 2/3 of 1F1B's."""
    from llamapipe.tools.plan_parallelism import SCHEDULES
    assert {"group-interleaved", "1f1b-v"} <= set(SCHEDULES)
    model = LlamaConfig(**PRESETS["llama2-7b"])
    est = {(s, v): estimate(model, Layout(1, 8, v, 1, s, 1, "selective", False), 4096, 64, DEVICES["h100"])
           for s, v in (("1f1b", 1), ("interleaved", 2), ("group-interleaved", 2), ("1f1b-v", 2))}
    grouped, inter, one = est["group-interleaved", 2], est["interleaved", 2], est["1f1b", 1]
    assert grouped.step_s == pytest.approx(inter.step_s, rel=1e-9)
    assert grouped.activations < inter.activations and grouped.activations <= 1.05 * one.activations
    assert est["1f1b-v", 2].activations <= 0.8 * one.activations
