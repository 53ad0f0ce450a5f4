"""--pipeline-schedule-file (training/arguments/schedule_file_args.py) and file:PATH specs (training/schedule_file.py):
the flag stands for --pipeline-schedule file:PATH with the file's chunks per rank; a bad or missing file and a
contradicting flag are one error line while parsing; a file's spec answers what a named spec answers without
joining the table, and refuses a run of another size in one sentence."""
import pytest

from llamapipe.core.pipeline_parallel.schedule_specs import FILE_PREFIX, SPECS, build
from llamapipe.training.arguments.parser import build_parser
from llamapipe.training.schedule_file import load_schedule, write_schedule_file

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--mock-data", "--vocab-size", "256", "--pipeline-model-parallel-size", "2"]


@pytest.fixture()
def v_half_file(tmp_path):
    path = str(tmp_path / "v_half.csv")
    write_schedule_file(build("v-half", 2, 2, 8), path)
    return path


def test_the_flag_is_the_file_schedule_with_its_chunks(v_half_file):
    args = build_parser().parse_args(BASE + ["--pipeline-schedule-file", v_half_file])
    assert (args.pipeline_schedule, args.num_virtual_stages_per_pipeline_rank) == (FILE_PREFIX + v_half_file, 2)
    one_chunk = v_half_file.replace("v_half", "zb_h1")
    write_schedule_file(build("zb-h1", 2, 1, 8), one_chunk)
    args = build_parser().parse_args(BASE + ["--pipeline-schedule-file", one_chunk])
    assert (args.pipeline_schedule, args.num_virtual_stages_per_pipeline_rank) == (FILE_PREFIX + one_chunk, None)


@pytest.mark.parametrize("extra, words", [
    (["--pipeline-schedule", "zbv"], "sets --pipeline-schedule file:{path}, which contradicts --pipeline-schedule zbv"),
    (["--num-virtual-stages-per-pipeline-rank", "3"], "sets --num-virtual-stages-per-pipeline-rank 2, which "
                                                       "contradicts --num-virtual-stages-per-pipeline-rank 3"),
])
def test_a_contradicting_flag_is_one_error_line(v_half_file, capsys, extra, words):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(BASE + extra + ["--pipeline-schedule-file", v_half_file])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(words.format(path=v_half_file) + "; drop one")


def test_a_bad_or_missing_file_is_one_error_line_while_parsing(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0I0\n1F0,1B0\n")
    for path, words in ((bad, f"--pipeline-schedule-file: schedule file {bad}: rank 0: missing W for chunk 0 "
                              "microbatch 0"),
                        (tmp_path / "none.csv", f"--pipeline-schedule-file {tmp_path / 'none.csv'}: no such file")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(BASE + ["--pipeline-schedule-file", str(path)])
        assert capsys.readouterr().err.splitlines()[-1] == f"pretrain_llama.py: error: {words}"


def test_a_files_spec_answers_like_a_named_one_without_joining_the_table(v_half_file):
    names = list(SPECS)
    spec = load_schedule(FILE_PREFIX + v_half_file)
    assert SPECS[FILE_PREFIX + v_half_file] is spec and list(SPECS) == names
    assert (spec.min_chunks, spec.max_chunks, spec.placement(2), spec.zero_bubble, spec.profiled) == \
        (2, 2, "v", True, False)
    assert spec.build(2, 2, 8).actions == build("v-half", 2, 2, 8).actions
    with pytest.raises(ValueError, match=f"schedule file {v_half_file} plans 8 microbatches on 2 pipeline ranks, "
                                         "but this run has 4 microbatches on 2"):
        spec.build(2, 2, 4)
    with pytest.raises(ValueError, match="--pipeline-schedule file:/no/such.csv: no such file"):
        load_schedule("file:/no/such.csv")


def test_the_start_up_line_says_what_the_simulator_found(v_half_file):
    from llamapipe.core.pipeline_parallel.simulator import simulate
    from llamapipe.training.arguments.megatron_compat import check_compat
    lines = check_compat(build_parser().parse_args(BASE + ["--pipeline-schedule-file", v_half_file]))
    result = simulate(build("v-half", 2, 2, 8))
    assert lines == [f"--pipeline-schedule-file {v_half_file}: verified, pp 2, 2 model chunks per rank (v placement), "
                     f"8 microbatches, B/W split; simulated at unit costs: bubble {result.bubble_rate:.1%}, peak "
                     f"{max(result.peak_memory):g} microbatch-chunks of activations"]
    assert check_compat(build_parser().parse_args(BASE)) == []
