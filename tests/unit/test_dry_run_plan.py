"""`llamapipe plan` and the dry run (issue 41): plan's per-rank memory against the dry run's for 10 layouts, its
interleaved layouts with 2 to 8 chunks per rank, and the top row's dry-run command.

The planner counts parameters, gradients and optimizer state from the model's shape and models activations per
layer (tools/parallel_estimate.py); the dry run builds the real shards on meta tensors and follows what the
executor keeps alive while the plan runs, so the two are independent: the counted parts must agree within 1%,
the totals within 5% (the communication buffers, which the planner leaves out, are not in the totals)."""
import shlex

import pytest

from llamapipe.model.families import PRESETS
from llamapipe.model.llama import LlamaConfig
from llamapipe.tools.parallel_estimate import Layout, rank_memory
from llamapipe.tools.plan_parallelism import layouts, main as plan_main, uneven_layout
from llamapipe.training.dry_run.main import build_parser, dry_run_config, run
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
    "pp4 vpp2 dualpipev bf16": (4, ["--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank",
                                    "2", "--pipeline-schedule", "dualpipev", "--bf16"]),
}


def planned(config) -> list:
    par, opt = config.parallel, config.optimizer
    layout = Layout(par.tp_size, par.pp_size, par.vpp_size, par.dp_size, par.pipeline_schedule, MICRO_BATCH,
                    config.model.recompute_granularity or "none", opt.use_distributed_optimizer,
                    "bf16" if opt.bf16 else "fp32", par.pipeline_layout, cp=par.cp_size)
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
        total = dry.params + dry.grads + dry.optimizer + dry.activations
        assert plan.total == pytest.approx(total, rel=0.05), f"{where}: total"


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
