"""--pipeline-model-parallel-layout auto resolved at parse time (training/arguments/auto_layout.py): the split
from a profile is the one `plan --profile` picks for the same layout, the analytic split unloads the vocabulary
stages, the chunks per rank follow the chunk flags and the schedule, and bad input is one line naming the flag
and the file."""
from __future__ import annotations

import json

import pytest

from llamapipe.core.config import ArgumentError
from llamapipe.core.pipeline_parallel.layout import layout_layer_counts
from llamapipe.core.pipeline_parallel.schedule_specs import SPECS
from llamapipe.core.pipeline_parallel.stage_balance import stage_ranks
from llamapipe.tools.parallel_estimate import Layout
from llamapipe.tools.profile_predict import balanced_counts as plan_balanced_counts
from llamapipe.training import profile_schema
from llamapipe.training.arguments.auto_layout import resolve_auto_layout
from llamapipe.training.arguments.model_args import model_config
from llamapipe.training.arguments.parser import build_parser, config_from_args
from tests.unit.test_profile_planner import synthetic_profile

SHAPE = ["--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "64", "--global-batch-size", "8", "--mock-data"]


@pytest.fixture(autouse=True)
def _torchrun_threads(monkeypatch):
    """The ranks' thread count a profile must match is torchrun's 1 here, whatever this shell exports."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def resolve(*flags: str, vocab: int = 256, device: str = "cpu"):
    args = build_parser().parse_args(SHAPE + ["--vocab-size", str(vocab), *flags])
    notices: list[str] = []
    out = resolve_auto_layout(args, model_config(args, []), 32, device, notices)
    return out, notices


def write_profile(tmp_path, head_ms=(6.0, 6.0, 6.0), **model) -> str:
    profile = synthetic_profile(head=head_ms, num_layers=8)
    profile["model"].update(model)
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(profile))
    return str(path)


def test_profiled_split_is_the_one_plan_prints_and_the_notice_says_why(tmp_path):
    path = write_profile(tmp_path)
    out, notices = resolve("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "auto",
                           "--pipeline-profile", path)
    counts = layout_layer_counts(out.pipeline_model_parallel_layout, 8, 2)
    profile = profile_schema.load(path)
    lay = Layout(1, 2, 1, 1, "1f1b", 1, "none", False, precision="fp32")
    assert counts == plan_balanced_counts(profile, lay) == [7, 1]     # head = 6 layers' work: 21 vs 21 ms
    assert notices == [f"notice: --pipeline-model-parallel-layout auto chose 'Et*7|tL' (layers per virtual stage "
                       f"7/1) from the measured costs in --pipeline-profile {path}: F+B+W per microbatch on each "
                       "pipeline rank 21.0/21.0 ms (even split 4/4: 12.0/30.0 ms)"]


def test_analytic_split_gives_the_vocabulary_stages_fewer_layers_and_says_so():
    out, notices = resolve("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "auto",
                           vocab=32000)
    counts = layout_layer_counts(out.pipeline_model_parallel_layout, 8, 2)
    assert counts[1] < counts[0]
    assert "from the analytic FLOP model (no --pipeline-profile; the embedding and the output layer + loss counted " \
           "at vocabulary 32000)" in notices[0]
    even, _ = resolve("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "auto",
                      "--enable-vocab-parallel", vocab=32000)
    assert even.pipeline_model_parallel_layout == "Et*4|t*4L"


@pytest.mark.parametrize("flags,stages", [
    (["--num-layers-per-virtual-pipeline-stage", "2"], 4),
    (["--num-virtual-stages-per-pipeline-rank", "2"], 4),
    (["--pipeline-schedule", "zbv"], 4),
    (["--pipeline-schedule", "1f1b"], 2),
])
def test_chunks_per_rank_come_from_the_chunk_flags_or_the_schedule(flags, stages):
    out, _ = resolve("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "auto", *flags)
    assert len(layout_layer_counts(out.pipeline_model_parallel_layout, 8, 2)) == stages
    assert out.num_layers_per_virtual_pipeline_stage is None


def test_nothing_to_split_on_one_stage_and_explicit_layouts_pass_through():
    out, notices = resolve("--pipeline-model-parallel-layout", "auto")
    assert out.pipeline_model_parallel_layout is None and "nothing to split" in notices[0]
    out, notices = resolve("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*3|t*5L")
    assert out.pipeline_model_parallel_layout == "Et*3|t*5L" and notices == []


def one_line(flags, **kw) -> str:
    with pytest.raises(ArgumentError) as err:
        resolve("--pipeline-model-parallel-size", "2", *flags, **kw)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_profiles_are_one_line_naming_the_flag_and_the_file(tmp_path):
    auto = ["--pipeline-model-parallel-layout", "auto", "--pipeline-profile"]
    missing = str(tmp_path / "none.json")
    assert one_line(auto + [missing]).startswith(f"--pipeline-profile {missing}: cannot read it")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert one_line(auto + [str(broken)]).startswith(f"--pipeline-profile {broken}: not JSON")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "other/1"}))
    assert one_line(auto + [str(wrong)]).startswith(f"--pipeline-profile {wrong}: schema is 'other/1'")
    other = write_profile(tmp_path, hidden_size=128)
    assert one_line(auto + [other]) == (f"--pipeline-profile {other} was made for a model with hidden_size 128, but "
                                        "this run's is 64; profile this model with `llamapipe profile`")
    path = write_profile(tmp_path)
    assert one_line(auto + [path, "--micro-batch-size", "2"]) == (
        f"--pipeline-profile {path} has no entry for --micro-batch-size 2 with recompute none (it has micro-batch "
        "size/recompute 1/none)")
    assert one_line(auto + [path, "--bf16"]) == f"--pipeline-profile {path} was measured at precision fp32, but " \
                                                "this run's is bf16"


def test_flags_that_contradict_auto_are_one_line(tmp_path):
    path = write_profile(tmp_path)
    assert one_line(["--pipeline-profile", path]) == \
        f"--pipeline-profile {path} is read only by --pipeline-model-parallel-layout auto"
    assert one_line(["--pipeline-model-parallel-layout", "auto", "--decoder-last-pipeline-num-layers", "3"]) == \
        "--pipeline-model-parallel-layout auto picks the layer split itself; drop --decoder-last-pipeline-num-layers"


def test_the_profiled_split_counts_tensor_parallel_collectives(tmp_path):
    """A profile whose all-reduces are slow (1 ms latency) adds the same time to every layer under tp 2, which
    moves the balance towards the even split compared with compute alone."""
    profile = synthetic_profile(head=(6.0, 6.0, 6.0), num_layers=8)
    profile["comm"].update(allreduce_latency_s=1e-3)
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    out, notices = resolve("--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel", "--pipeline-model-parallel-layout", "auto", "--pipeline-profile",
                           str(path))
    counts = layout_layer_counts(out.pipeline_model_parallel_layout, 8, 2)
    assert counts == [5, 3], notices


@pytest.mark.parametrize("schedule", [name for name in SPECS if not name.startswith("file:")])
def test_every_schedule_validates_the_layout_auto_chose(schedule):
    """Through the whole argument check: the chosen layout string has the schedule's chunks per rank and the
    rank holding the output layer gets fewer layers than the even split gives it (vocabulary 4096)."""
    args = build_parser().parse_args(SHAPE + ["--vocab-size", "4096", "--pipeline-model-parallel-size", "2",
                                              "--pipeline-schedule", schedule,
                                              "--pipeline-model-parallel-layout", "auto"])
    par = config_from_args(args, 2).parallel
    counts = layout_layer_counts(par.pipeline_layout, 8, 2)
    assert SPECS[schedule].accepts(par.vpp_size) and len(counts) == 2 * par.vpp_size
    ranks = stage_ranks(2, par.vpp_size, SPECS[schedule].placement(par.vpp_size))
    head_rank = ranks[-1]
    assert sum(n for n, r in zip(counts, ranks) if r == head_rank) < 8 / 2


def test_a_profile_with_a_time_that_is_not_finite_is_one_line(tmp_path):
    """Issue 40: --pipeline-profile with a NaN or inf time gave a lopsided split (`Et|t*7L`) without a word."""
    profile = synthetic_profile(num_layers=8)
    profile["entries"][0]["head"]["f"] = float("inf")
    path = tmp_path / "inf.json"
    path.write_text(json.dumps(profile))
    assert one_line(["--pipeline-model-parallel-layout", "auto", "--pipeline-profile", str(path)]) == \
        f"--pipeline-profile {path}: entries[0].head.f is inf; expected a finite non-negative number"


def test_auto_split_counts_the_tokenizers_vocabulary_not_the_presets(tmp_path, llamapipe_log):
    """issue 39, item 3: the tiny preset says 1024, the tokenizer has 8192 ids; the split and its notice use
    8192, the vocabulary the run trains (the layout differs from the one 1024 gives)."""
    from tokenizers import Tokenizer, models
    vocab = {f"w{i}": i for i in range(8192)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    flags = ["--model", "tiny", "--mock-data", "--pipeline-model-parallel-size", "2",
             "--pipeline-model-parallel-layout", "auto", "--global-batch-size", "4"]
    config = config_from_args(build_parser().parse_args(flags + ["--tokenizer-model", str(tmp_path)]), 2)
    assert config.model.vocab_size == 8192
    notice = [line for line in llamapipe_log if "layout auto chose" in line]
    assert len(notice) == 1 and "counted at vocabulary 8192)" in notice[0], notice
    args = build_parser().parse_args(flags)
    want = resolve_auto_layout(args, model_config(args, []).replace(vocab_size=8192), 128, "cpu", [])
    preset = resolve_auto_layout(args, model_config(args, []), 128, "cpu", [])
    assert want.pipeline_model_parallel_layout != preset.pipeline_model_parallel_layout
    assert config.parallel.pipeline_layout == want.pipeline_model_parallel_layout


@pytest.mark.parametrize("vocab", [256, 512, 768, 1024, 2048, 8192])
def test_auto_schedule_chooses_vocabulary_parallelism_where_it_beats_the_layer_split_by_the_margin(vocab):
    """issue 42: --pipeline-schedule auto with layout auto turns vocabulary parallelism on exactly when the even
    split with the vocabulary layers on every rank leaves the busiest rank less work than the best layer split by
    more than VOCAB_PARALLEL_MARGIN (recomputed here from the work model); other schedules keep the user's choice."""
    from llamapipe.core.pipeline_parallel.stage_balance import (ELEMENT_FLOPS, analytic_parts, balanced_counts,
                                                                even_counts, rank_work)
    from llamapipe.training.arguments.auto_layout import VOCAB_PARALLEL_MARGIN
    parts = analytic_parts(hidden=64, ffn_hidden=128, heads=4, kv_heads=4, head_dim=16, vocab=vocab, seq_length=32,
                           micro_batch=1, element_flops=ELEMENT_FLOPS["cpu"])
    layers = balanced_counts(parts, 8, [0, 1])
    ratio = max(rank_work(parts, [4, 4], [0, 1], True)) / max(rank_work(parts, layers, [0, 1]))
    flags = ("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "auto")
    out, notices = resolve(*flags, "--pipeline-schedule", "auto", vocab=vocab)
    assert out.enable_vocab_parallel == (ratio < 1 - VOCAB_PARALLEL_MARGIN), (vocab, ratio)
    if out.enable_vocab_parallel:
        assert out.pipeline_model_parallel_layout == "Et*4|t*4L"
        assert "vocabulary parallelism, chosen with --pipeline-schedule auto" in notices[0]
        assert f"best layer split {'/'.join(map(str, layers))} without it" in notices[0], notices
    else:
        assert layout_layer_counts(out.pipeline_model_parallel_layout, 8, 2) == layers
    assert not resolve(*flags, "--pipeline-schedule", "1f1b", vocab=vocab)[0].enable_vocab_parallel
    assert resolve(*flags, "--pipeline-schedule", "1f1b", "--enable-vocab-parallel", vocab=vocab)[0].enable_vocab_parallel


def test_chosen_vocabulary_parallelism_reaches_the_parallel_config():
    args = build_parser().parse_args(SHAPE + ["--vocab-size", "8192", "--pipeline-model-parallel-size", "2",
                                              "--pipeline-model-parallel-layout", "auto", "--pipeline-schedule", "auto"])
    config = config_from_args(args, 2)
    assert config.parallel.vocab_parallel and config.parallel.pipeline_layout == "Et*4|t*4L"
