"""Megatron-LM torch_dist checkpoints both ways (convert-megatron), with megatron-core itself as the reference:
a GPTModel saved by megatron-core imports here with its logits (fp32, 1e-5), and our checkpoint exported back
loads into megatron-core's GPTModel with the same logits. Bad input: one line, nothing written."""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from tests import megatron_cpu as mc

TOL = 1e-5


@pytest.fixture(scope="module")
def megatron():
    mc.require()
    import torch.distributed as dist
    from megatron.core import parallel_state
    started = not dist.is_initialized()
    mc.init_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(megatron, tmp_path_factory):
    """(mcore model, its logits on `tokens`, tokens, Megatron save dir) at iteration 7."""
    root = tmp_path_factory.mktemp("megatron_save")
    model = mc.build_model(seed=3)
    tokens = torch.randint(0, mc.TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    mc.save_megatron(model, str(root), 7)
    return model, mc.forward(model, tokens), tokens, str(root)


def _our_logits(save_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from llamapipe.core.parallel_state import ParallelState
    from llamapipe.model.families import config_from_dict, family_of
    from llamapipe.training.checkpointing import io as cio
    path = cio.latest_checkpoint(save_dir)[1]
    reader = cio.CheckpointReader(path)
    config = config_from_dict(reader.meta["model_config"])
    model = family_of(config).model_class(config, ParallelState(tp_size=1, world_size=1))
    model.load_logical_state_dict({key: reader.logical(key) for key in reader.keys("model")})
    with torch.no_grad():
        return model.eval()(tokens)[..., :mc.TINY["vocab_size"]], reader.meta


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_a_megatron_save_imports_with_megatron_cores_logits(saved, tmp_path, tp, pp):
    from llamapipe.tools.convert_megatron import import_megatron
    _, reference, tokens, root = saved
    out = import_megatron(root, str(tmp_path / "ours"), tp=tp, pp=pp)
    assert os.path.basename(out) == "iter_0000007"
    logits, meta = _our_logits(str(tmp_path / "ours"), tokens)
    assert meta["iteration"] == 7
    torch.testing.assert_close(logits, reference, rtol=0, atol=TOL)


def test_our_checkpoint_exports_to_megatron_core_with_equal_logits(saved, tmp_path):
    from megatron.core import dist_checkpointing
    from llamapipe.tools.convert_megatron import export_megatron, import_megatron
    _, reference, tokens, root = saved
    import_megatron(root, str(tmp_path / "ours"), tp=2, pp=2)
    out = export_megatron(str(tmp_path / "ours"), str(tmp_path / "back"))
    assert open(tmp_path / "back" / "latest_checkpointed_iteration.txt").read() == "7"
    fresh = mc.build_model(seed=11)   # other weights until the load
    assert (mc.forward(fresh, tokens) - reference).abs().max() > 1e-2
    with mc.cpu_patches():
        state = dist_checkpointing.load(fresh.sharded_state_dict(prefix=""), out)
    fresh.load_state_dict(state, strict=False)
    torch.testing.assert_close(mc.forward(fresh, tokens), reference, rtol=0, atol=TOL)


def _refused(load, save, match):
    from llamapipe.tools.convert_megatron import import_megatron
    with pytest.raises(ValueError, match=match):
        import_megatron(load, save)
    assert not os.path.exists(save)


def _copy(root, tmp_path):
    import shutil
    shutil.copytree(root, tmp_path / "meg")
    return tmp_path / "meg", tmp_path / "meg" / "iter_0000007"


def test_another_architecture_is_refused(megatron, tmp_path):
    model = mc.build_model(seed=1)
    mc.save_megatron(model, str(tmp_path / "moe"), 1, mc.megatron_args(num_experts=8))
    _refused(str(tmp_path / "moe"), str(tmp_path / "ours"), "mixture-of-experts model .8 experts")
    mc.save_megatron(model, str(tmp_path / "ln"), 1, mc.megatron_args(normalization="LayerNorm"))
    _refused(str(tmp_path / "ln"), str(tmp_path / "ours"), "normalization LayerNorm")


def test_a_missing_or_truncated_shard_is_refused(saved, tmp_path):
    root, path = _copy(saved[3], tmp_path)
    shard = path / "__0_1.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    _refused(str(root), str(tmp_path / "ours"), "a shard file is damaged or short")
    shard.unlink()
    _refused(str(root), str(tmp_path / "ours"), "lacks shard file __0_1.distcp")


def test_a_common_file_that_is_not_a_state_dict_is_refused_without_running_it(saved, tmp_path):
    root, path = _copy(saved[3], tmp_path)
    torch.save([1, 2, 3], path / "common.pt")
    _refused(str(root), str(tmp_path / "ours"), "holds a list, not a Megatron checkpoint's state dict")

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))
    with open(path / "common.pt", "wb") as fh:
        pickle.dump({"args": Boom(), "iteration": 1}, fh)
    with pytest.raises(ValueError):
        from llamapipe.tools.convert_megatron import import_megatron
        import_megatron(str(root), str(tmp_path / "ours"))
    assert not (tmp_path / "ran").exists() and not (tmp_path / "ours").exists()


def _run(argv, **kwargs):
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(argv, capture_output=True, text=True, env=env, **kwargs)


def test_the_command_line_refuses_a_directory_that_is_no_megatron_save_in_one_line(tmp_path):
    import sys
    result = _run([sys.executable, "-m", "llamapipe", "convert-megatron", "import", "--load", str(tmp_path),
                   "--save", str(tmp_path / "ours")])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"convert_megatron.py: error: --load {tmp_path} is not a Megatron save directory "
        "(no latest_checkpointed_iteration.txt, no .metadata)"]
    assert not (tmp_path / "ours").exists()


@pytest.mark.slow
def test_the_round_trip_example_gives_megatron_core_its_logits_back(saved, tmp_path):
    import sys
    from megatron.core import dist_checkpointing
    from tests.harness import ROOT
    _, reference, tokens, root = saved
    result = _run(["bash", os.path.join(ROOT, "examples", "megatron", "round_trip.sh"), root, str(tmp_path)],
                  cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    fresh = mc.build_model(seed=12)
    with mc.cpu_patches():
        state = dist_checkpointing.load(fresh.sharded_state_dict(prefix=""), str(tmp_path / "megatron" / "iter_0000007"))
    fresh.load_state_dict(state, strict=False)
    torch.testing.assert_close(mc.forward(fresh, tokens), reference, rtol=0, atol=TOL)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_a_legacy_megatron_save_imports_with_megatron_cores_logits(saved, tmp_path, tp, pp):
    from llamapipe.tools.convert_megatron import import_megatron
    model, reference, tokens, _ = saved
    mc.save_megatron_legacy(model, str(tmp_path / "legacy"), 9, tp=tp, pp=pp)
    out = import_megatron(str(tmp_path / "legacy"), str(tmp_path / "ours"), tp=2, pp=1)
    assert os.path.basename(out) == "iter_0000009"
    logits, _ = _our_logits(str(tmp_path / "ours"), tokens)
    torch.testing.assert_close(logits, reference, rtol=0, atol=TOL)


def test_a_legacy_file_that_is_not_a_state_dict_or_a_missing_rank_is_refused(saved, tmp_path):
    path = mc.save_megatron_legacy(saved[0], str(tmp_path / "legacy"), 9, tp=2, pp=1)
    os.rename(os.path.join(path, "mp_rank_01"), os.path.join(tmp_path, "away"))
    _refused(str(tmp_path / "legacy"), str(tmp_path / "ours"), "lacks the shard of tensor rank 1, pipeline rank 0")
    torch.save(torch.zeros(3), os.path.join(path, "mp_rank_00", "model_optim_rng.pt"))
    _refused(str(tmp_path / "legacy"), str(tmp_path / "ours"), "holds a Tensor, not a Megatron checkpoint's state")


@pytest.mark.parametrize("legacy", [False, True])
def test_use_checkpoint_args_takes_the_model_from_a_megatron_saves_args(saved, tmp_path, legacy):
    """--load of a Megatron save with --use-checkpoint-args: the shape, query groups, RoPE base, sequence and
    vocabulary from its args (common.pt, or a legacy rank file), as from a checkpoint of ours."""
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    root = str(tmp_path / "meg")
    if legacy:
        mc.save_megatron_legacy(saved[0], root, 9)
    else:
        import shutil
        shutil.copytree(saved[3], root)
    config = config_from_args(build_parser().parse_args(["--mock-data", "--load", root, "--use-checkpoint-args"]), 1)
    model = config.model
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads,
            model.num_query_groups, model.vocab_size, model.rope_theta, model.tie_word_embeddings) == \
        (2, 64, 160, 4, 2, 128, 10000.0, False)
    assert config.training.seq_length == 32


def test_args_that_do_not_fit_the_tensors_are_refused(saved, tmp_path):
    from llamapipe.training.checkpointing.megatron_read import read_megatron
    root, path = _copy(saved[3], tmp_path)
    args = mc.megatron_args(dict(num_attention_heads=8, num_query_groups=8))   # the tensors have 4 heads, 2 groups
    torch.save({"args": args, "iteration": 7, "checkpoint_version": 3.0}, path / "common.pt")
    with pytest.raises(ValueError, match="do not fit 8 heads in 8 query groups"):
        read_megatron(str(root))


@pytest.mark.slow
def test_a_save_by_megatron_at_tp2_pp2_imports_with_the_logits_megatron_core_loads_it_with(megatron, tmp_path):
    """4 gloo processes save a tp 2 x pp 2 GPTModel as Megatron does; megatron-core itself loads that save into
    a tp 1 model (the reference), and our import at tp 1 and at tp 2 x pp 2 gives its logits."""
    import torch.multiprocessing as tmp
    from megatron.core import dist_checkpointing
    from benchmarks.launch import free_port
    from llamapipe.tools.convert_megatron import import_megatron
    root = str(tmp_path / "meg")
    tmp.spawn(mc.save_parallel_worker, args=(2, 2, root, free_port(), 21), nprocs=4, join=True)
    reference = mc.build_model(seed=99)
    with mc.cpu_patches():
        state = dist_checkpointing.load(reference.sharded_state_dict(prefix=""), os.path.join(root, "iter_0000003"))
    reference.load_state_dict(state, strict=False)
    tokens = torch.randint(0, mc.TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    want = mc.forward(reference, tokens)
    for tp, pp in ((1, 1), (2, 2)):
        import_megatron(root, str(tmp_path / f"ours{tp}{pp}"), tp=tp, pp=pp)
        logits, meta = _our_logits(str(tmp_path / f"ours{tp}{pp}"), tokens)
        assert meta["iteration"] == 3
        torch.testing.assert_close(logits, want, rtol=0, atol=TOL)


def test_ckpt_format_torch_dist_keeps_ours_in_a_subdirectory_and_other_formats_are_one_line(tmp_path):
    from llamapipe.core.config import ArgumentError
    from llamapipe.training.arguments.parser import build_parser, config_from_args
    argv = ["--mock-data", "--save", str(tmp_path), "--ckpt-format"]
    checkpoint = config_from_args(build_parser().parse_args(argv + ["torch_dist"]), 1).checkpoint
    assert (checkpoint.save, checkpoint.megatron_save) == (str(tmp_path / "llamapipe"), str(tmp_path))
    assert config_from_args(build_parser().parse_args(argv + ["torch"]), 1).checkpoint.save == str(tmp_path)
    with pytest.raises(ArgumentError, match="^--ckpt-format zarr is not supported: give torch .llamapipe's "
                                            r"checkpoints. or torch_dist .Megatron-LM's as well.$"):
        config_from_args(build_parser().parse_args(argv + ["zarr"]), 1)
    with pytest.raises(ArgumentError, match="^--ckpt-format torch_dist writes Megatron-LM's LLaMA-shaped GPTModel, "
                                            "but this run's model is a qwen2 model; save with --ckpt-format torch$"):
        config_from_args(build_parser().parse_args(argv + ["torch_dist", "--add-qkv-bias"]), 1)


def test_keep_last_n_prunes_only_the_megatron_copies_this_writer_made(tmp_path):
    """Copies whose checkpoint of ours was pruned go; a kept one and a Megatron run's own iter dir stay."""
    import argparse
    from llamapipe.training.checkpointing.megatron_save import prune_copies
    for iteration, exported in ((1, None), (2, "ours/iter_0000002"), (4, "ours/iter_0000004")):
        path = tmp_path / f"iter_{iteration:07d}"
        path.mkdir()
        torch.save({"args": argparse.Namespace(exported_from=exported), "iteration": iteration}, path / "common.pt")
    (tmp_path / "llamapipe" / "iter_0000004").mkdir(parents=True)
    assert prune_copies(str(tmp_path), str(tmp_path / "llamapipe")) == [2]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "iter_0000004", "llamapipe"]
