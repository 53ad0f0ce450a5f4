"""`llamapipe plan` and the dry run (issues 41, 50): plan's per-rank memory against the dry run's for 14 layouts
and for the published LLaMA-3.1-70B and 405B layouts, its interleaved layouts with 2 to 8 chunks per rank, and the
top row's dry-run command (the LLaMA-3.1-8B plan at 131,072 tokens and its dry runs: tests/unit/test_plan_seq1f1b.py).

The planner counts parameters, gradients and optimizer state from the model's shape and models activations per
layer (tools/parallel_estimate.py); the dry run builds the real shards on meta tensors and follows what the
executor keeps alive while the plan runs, so the two are independent: the counted parts must agree within 1%,
the totals within 5% on the tiny model, 3% on the published layouts. Both count the communication buffers with
one model (core/comm_memory.py), fed by the planner from the shape and by the dry run from the real shards."""
import shlex

import pytest

from llamapipe.model.families import PRESETS
from llamapipe.model.llama import LlamaConfig
from llamapipe.tools.parallel_estimate import DEVICES, Layout, estimate, rank_memory
from llamapipe.tools.plan_parallelism import build_parser as plan_parser, dry_run_command, layouts, \
    main as plan_main, model_from_args, uneven_layout
from llamapipe.training.dry_run.main import build_parser, dry_run_config, main as dry_run_main, run
from llamapipe.training.dry_run.rank import RoleRun
from llamapipe.training.dry_run.world import roles
from tests.cli import TINY

GLOBAL_BATCH, MICRO_BATCH = 8, 2
BASE = TINY + ["--train-iters", "2", "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", str(MICRO_BATCH)]
PP2 = ["--pipeline-model-parallel-size", "2"]
V2 = PP2 + ["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {  # name: (world size, flags)
    "tp2 fp32": (2, TP2),
    "pp2 1f1b full recompute": (2, PP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
    "pp2 zbv": (2, V2 + ["zbv"]),
    "pp2 v-half selective bf16": (2, V2 + ["v-half", "--recompute-activations", "--bf16"]),
    "dp2 zero1 bf16": (2, ["--use-distributed-optimizer", "--bf16"]),
    "pp2 layout Ettt|tttttL bf16": (2, PP2 + ["--pipeline-model-parallel-layout", "Ettt|tttttL", "--bf16"]),
    "pp2 vpp2 interleaved dp2 zero1": (4, V2 + ["interleaved", "--use-distributed-optimizer"]),
    "tp2 pp2 v-min bf16": (4, V2 + ["v-min", "--bf16"] + TP2),
    "cp2 dp2 zero1": (4, ["--context-parallel-size", "2", "--use-distributed-optimizer"]),
    "cp2 a2a bf16": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--bf16"]),   # all-to-all buffers
    "pp4 vpp2 dualpipev bf16": (4, ["--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank",
                                    "2", "--pipeline-schedule", "dualpipev", "--bf16"]),
    "cp4 a2a+p2p 2x2 bf16": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                 "--hierarchical-context-parallel-sizes", "2", "2", "--bf16"]),
    "pp2 1f1b seq1f1b 2 pieces": (2, PP2 + ["--num-seq-splits", "2"]),          # the pieces' own bytes, walked
    "pp2 zbv seq1f1b 4 pieces bf16": (2, V2 + ["zbv", "--num-seq-splits", "4", "--bf16"]),
}


def planned(config) -> list:
    par, opt = config.parallel, config.optimizer
    layout = Layout(par.tp_size, par.pp_size, par.vpp_size, par.dp_size, par.pipeline_schedule, MICRO_BATCH,
                    config.model.recompute_granularity or "none", opt.use_distributed_optimizer,
                    "bf16" if opt.bf16 else "fp32", par.pipeline_layout, cp=par.cp_size, cp_comm=par.cp_comm_type,
                    cp_a2a=par.cp_a2a_size or 0, seq_splits=par.num_seq_splits)
    return rank_memory(config.model, layout, config.training.seq_length, GLOBAL_BATCH)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plans_memory_agrees_with_the_dry_run(name):
    world, flags = LAYOUTS[name]
    config = dry_run_config(build_parser().parse_args(["--world-size", str(world)] + BASE + flags))
    result = run(config)
    assert result.problems == []
    for pp_rank, plan in enumerate(planned(config)):
        dry = max((r for r in result.reports if r.role.coords["pp"] == pp_rank),
                  key=lambda r: r.params + r.grads + r.optimizer + r.activations)
        where = f"{name}, pp rank {pp_rank}"
        for part in ("params", "grads", "optimizer"):
            assert getattr(plan, part) == pytest.approx(getattr(dry, part), rel=0.01), f"{where}: {part}"
        assert plan.comm == dry.comm, f"{where}: communication buffers"
        assert plan.total == pytest.approx(dry.total, rel=0.05), f"{where}: total"


# (GPUs, global batch, layout): LLaMA-3.1-70B on 64 x 80 GB at seq 8192 as docs/cluster.md runs it, and
# LLaMA-3.1-405B at tp 8 x pp 16 x dp 2; with the fewest microbatches whose peak the planner puts at that of 256
# (12 and 16 a step), since the dry run's steps cost in proportion to them
PUBLISHED = {
    "llama3.1-70b tp4 pp8 dp2 v-half": (64, 24, Layout(4, 8, 2, 2, "v-half", 1, "none", True)),
    "llama3.1-405b tp8 pp16 dp2 1f1b full recompute": (256, 32, Layout(8, 16, 1, 2, "1f1b", 1, "full", True,
                                                                       pipeline_layout=uneven_layout(126, 16))),
}


@pytest.mark.slow      # the dry run's steps on meta: 10-15 s (70B) and 25-55 s (405B) on 2 shared cores
@pytest.mark.parametrize("name", list(PUBLISHED))
def test_plans_estimate_is_within_3_percent_of_the_dry_runs_busiest_rank(name):
    """The planner's GiB for the layout (its most loaded rank, what it holds under the headroom) against the
    busiest rank of the dry run of the command plan prints for it. Only tp rank 0 of each stage runs: the other tp
    ranks hold shards of the same shapes (the dry run reuses their step)."""
    gpus, global_batch, lay = PUBLISHED[name]
    args = plan_parser().parse_args(["--model", name.split()[0], "--gpus", str(gpus), "--seq-length", "8192",
                                     "--global-batch-size", str(global_batch)])
    model = model_from_args(args)
    planned = estimate(model, lay, args.seq_length, global_batch, DEVICES["h100"])
    cmd = shlex.split(dry_run_command(args, lay, model))
    config = dry_run_config(build_parser().parse_args(cmd[2:] + ["--train-iters", "1"]))
    job = RoleRun(config)
    busiest = max((job.run(role) for role in roles(config.parallel) if role.coords["tp"] == 0),
                  key=lambda r: r.total)
    assert job.ledger.problems() == []
    assert planned.comm == busiest.comm, "the communication buffers are one model"
    assert planned.total == pytest.approx(busiest.total, rel=0.03), (planned, busiest.total)


def test_plan_lists_interleaved_layouts_with_2_to_8_chunks_where_the_layers_divide():
    model = LlamaConfig(**PRESETS["llama2-70b"])
    found = {(lay.vpp, lay.pipeline_layout) for lay in layouts(model, 64, 256, 1)
             if lay.schedule == "interleaved" and lay.pp == 8}
    assert {vpp for vpp, split in found if split is None} == {2, 5}          # 80 layers over 16 and 40 stages
    assert {vpp for vpp, split in found if split is not None} == {3, 4, 6, 7, 8}
    assert {lay.vpp for lay in layouts(model, 64, 256, 1) if lay.schedule == "zbv"} == {2}


@pytest.mark.parametrize("layers, stages", [(80, 24), (80, 32), (126, 16), (10, 4)])
def test_an_uneven_layout_puts_the_extra_layers_in_the_middle(layers, stages):
    from llamapipe.core.pipeline_parallel.layout import layout_layer_counts
    text = uneven_layout(layers, stages)
    counts = layout_layer_counts(text, layers, stages)
    assert sum(counts) == layers and len(counts) == stages and max(counts) - min(counts) == 1
    assert counts[0] == counts[-1] == min(counts)


def test_the_top_rows_dry_run_command_is_printed_and_accepted(capsys):
    assert plan_main(["--model", "llama2-7b", "--gpus", "16", "--seq-length", "4096", "--global-batch-size", "64",
                      "--top", "3"]) == 0
    out = capsys.readouterr().out
    line = out.split("docs/dry_run.md):\n")[1].splitlines()[0]
    cmd = shlex.split(line)
    assert cmd[:4] == ["llamapipe", "dry-run", "--world-size", "16"] and "--mock-data" in cmd
    launch = shlex.split(out.split("Top row:")[1].strip())       # 16 GPUs: two nodes, the multi-node script
    assert cmd[6:] == launch[launch.index("scripts/launch_multi_node.sh") + 1:]   # the same job's flags (mock data too)
    args = build_parser().parse_args(cmd[2:] + ["--train-iters", "1"])
    assert dry_run_config(args).parallel.world_size == 16
