"""The dry run (training/dry_run, issue 41) on small jobs in this process: every role and group against the rank
grid, every pipeline message matched, the parameter count against the model's, the memory report and its exit
status, `pretrain_llama.py --dry-run`, the checkpoint files' sizes against a real save, and the message ledger
finding what disagrees. The mistakes a real run refuses are in test_dry_run_mistakes.py, the agreement with
`plan` in test_dry_run_plan.py, the bytes against real multi-process runs in tests/multiproc/test_dry_run_bytes.py."""
import dataclasses
import os

import pytest
import torch

from llamapipe.core.parallel_state import ParallelState
from llamapipe.core.pipeline_parallel.p2p_communication import Message
from llamapipe.model.families import model_parameters
from llamapipe.training.dry_run.main import build_parser, dry_run_config, main, run
from llamapipe.training.dry_run.messages import MessageLedger
from llamapipe.training.dry_run.world import GridGroups, check_groups, grid_of, roles
from tests.cli import TINY

BASE = TINY + ["--train-iters", "4", "--global-batch-size", "16", "--micro-batch-size", "2"]


def config_of(world: int, flags: list[str]):
    return dry_run_config(build_parser().parse_args(["--world-size", str(world)] + BASE + flags))


def test_roles_cover_every_rank_once_and_ranks_differing_in_dp_share_a_role():
    config = config_of(16, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                            "--pipeline-model-parallel-size", "2"])
    found = roles(config.parallel)
    assert len(found) == 2 * 2 * 2
    assert sorted(r for role in found for r in role.ranks) == list(range(16))
    grid = grid_of(config.parallel)
    for role in found:
        coords = [grid.coords(r) for r in role.ranks]
        assert [c["dp"] for c in coords] == [0, 1]
        assert all({a: c[a] for a in ("tp", "cp", "pp")} == role.coords for c in coords)


def test_a_group_that_disagrees_with_the_rank_grid_is_found():
    config = config_of(4, ["--tensor-model-parallel-size", "2"])
    grid = GridGroups(grid_of(config.parallel))
    ranks = {name: grid.of[name][0] for name in grid.of if 0 in grid.of[name]}
    check_groups(ParallelState(rank=0, world_size=4, sizes={"tp": 2, "dp": 2}, coords={"tp": 0, "dp": 0, "cp": 0,
                                                                                           "pp": 0}, ranks=ranks), grid)
    ranks["dp"] = (0, 1)
    with pytest.raises(AssertionError, match=r"group dp holds \(0, 1\), the rank grid says \(0, 2\)"):
        check_groups(ParallelState(rank=0, world_size=4, sizes={"tp": 2, "dp": 2},
                                   coords={"tp": 0, "dp": 0, "cp": 0, "pp": 0}, ranks=ranks), grid)


@pytest.mark.parametrize("world, flags", [
    (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
         "--bf16", "--use-distributed-optimizer"]),
    (4, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
         "--pipeline-schedule", "zbv", "--data-parallel-sharding-strategy", "optim_grads_params"]),
    (8, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--enable-vocab-parallel"]),
])
def test_a_small_job_runs_every_role_and_matches_every_message(world, flags):
    config = config_of(world, flags)
    result = run(config)
    par = config.parallel
    assert len(result.reports) == world // par.dp_size and result.problems == []
    assert result.steps == par.pp_size            # the tp and cp ranks of a stage share one step
    vocab = config.model.make_vocab_size_divisible_by * (par.pp_size if par.vocab_parallel else 1)
    assert result.parameters() == model_parameters(
        dataclasses.replace(config.model, make_vocab_size_divisible_by=vocab), par.tp_size)
    for report in result.reports:
        assert report.params > 0 and report.grads > 0 and report.optimizer > 0 and report.activations > 0


def test_the_ledger_names_messages_whose_sides_disagree_or_miss():
    ledger = MessageLedger()
    act, grad = Message("act", 1, 0, 0, 1), Message("grad", 0, 0, 1, 0)
    ledger.sent[act], ledger.taken[act] = ((4, 2, 8), torch.bfloat16), ((4, 2, 8), torch.float32)
    ledger.sent[grad] = ((4, 2, 8), torch.float32)
    assert ledger.problems() == [
        "grad of stage 0 microbatch 0 from pp rank 1 to 0: sent but never received",
        "act of stage 1 microbatch 0 from pp rank 0 to 1: sent as (4, 2, 8) bfloat16, received as (4, 2, 8) float32"]


def test_the_report_names_the_ranks_that_do_not_fit_and_exits_1(capsys):
    flags = ["--world-size", "8"] + BASE + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "parameters: " in out and "= the model's" in out and "run: 8 ranks = tp 2 x pp 2 x dp 2" in out
    assert main(flags + ["--gpu-memory-gb", "0.001"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("llamapipe dry-run: error: ranks 0-7 would not fit in --gpu-memory-gb 0.001: rank ")


def test_pretrain_llama_dry_run_is_the_same_command(capsys):
    from llamapipe.train import main as train_main
    assert train_main(["--dry-run", "--world-size", "4"] + BASE + ["--pipeline-model-parallel-size", "2"]) == 0
    assert "dry run: 4 ranks in 2 roles" in capsys.readouterr().out


def test_the_checkpoint_files_are_those_a_real_save_writes_with_their_sizes(tmp_path):
    """One rank, fp32 and bf16: the dry run's file list and shard sizes against save_checkpoint's files."""
    from llamapipe.core.optimizer import build_optimizer
    from llamapipe.training.checkpointing.save_load import finalize_async_save, save_checkpoint
    from llamapipe.training.dry_run.checkpoint import files_written
    from llamapipe.training.setup import build_model_chunks
    for precision in ([], ["--bf16"]):
        config = config_of(1, precision)
        chunks, _ = build_model_chunks(config, config.model, ParallelState(), torch.device("cpu"))
        save = str(tmp_path / f"ckpt{len(precision)}")
        save_checkpoint(save, 1, model_chunks=chunks, optimizer=build_optimizer(chunks, config.optimizer,
                                                                                 ParallelState()),
                        scheduler=None, parallel_state=None, config=config, consumed_samples=0)
        finalize_async_save()
        written = {name: os.path.getsize(os.path.join(save, "iter_0000001", name))
                   for name in os.listdir(os.path.join(save, "iter_0000001")) if name != "metadata.json"}
        meta_chunks, _ = build_model_chunks(config, config.model, ParallelState(), torch.device("meta"))
        dry = dict(files_written(meta_chunks, config, ParallelState()))
        assert sorted(dry) == sorted(written)
        for name in dry:
            if name.endswith(".safetensors"):
                assert dry[name] == written[name], name
            else:           # pickled random states: the same objects, sizes within a few bytes
                assert abs(dry[name] - written[name]) <= 64, name


def test_the_meta_cache_answers_repeated_operations_as_torch_does():
    from llamapipe.training.dry_run.meta_cache import MetaOpCache
    x, w = torch.empty(4, 3, device="meta"), torch.empty(5, 3, dtype=torch.bfloat16, device="meta")
    cache = MetaOpCache()

    def ops():
        return [x @ w.float().t(), torch.nn.functional.silu(x).t().contiguous(), x.add_(1.0)]
    with cache:
        first, again = ops(), ops()
        resized = [torch.mul(x, 2, out=torch.empty(0, device="meta")) for _ in range(2)]   # out= grows: not cached
    for a, b in zip(first, again):
        assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
    assert again[1] is not first[1] and again[2] is x
    assert [r.shape for r in resized] == [torch.Size([4, 3])] * 2
    assert len(cache._results) >= 3


def test_the_grid_groups_hold_one_tuple_per_group_linear_in_the_world():
    """Issue 51.4: each rank held its own copy of its data-parallel group (world^2 ints, 4.4 GB at 16,384 ranks);
    the ranks of a group now share one tuple, so the distinct tuples are the groups themselves."""
    config = config_of(64, ["--tensor-model-parallel-size", "2", "--global-batch-size", "64"])
    grid = GridGroups(grid_of(config.parallel))
    dp = grid.of["dp"]
    assert len({id(members) for members in dp.values()}) == 2            # tp 2: two dp groups of 32 ranks
    assert sum(len(members) for members in {id(m): m for m in dp.values()}.values()) == 64


def test_a_rank_above_the_headroom_is_warned_of_and_still_exits_0(capsys):
    """Issue 50.1: a rank at 95% of the card passed silently though docs/dry_run.md keeps 0.9 headroom."""
    flags = ["--world-size", "4"] + BASE + ["--pipeline-model-parallel-size", "2"]
    assert main(flags) == 0
    need = float(capsys.readouterr().out.split("needs ")[1].split(" MiB")[0]) / 1024
    assert main(flags + ["--gpu-memory-gb", f"{need / 0.95:.6f}"]) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("llamapipe dry-run: warning: rank ") and "above the 0.9 headroom" in err
