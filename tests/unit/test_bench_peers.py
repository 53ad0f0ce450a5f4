"""benchmarks/bench_peers.py's pure parts: the FLOPs it states per iteration, its table and docs section, and the
one-line reason a peer that cannot run gets (issue 48). Nothing here launches a framework."""
import math

import pytest

from benchmarks import bench_peers as bp


def _matmul_weights(vocab: int, shape: dict) -> int:
    """Elements of every matmul weight of our LlamaModel at `shape` (the embedding is a lookup, norms are not
    matmuls): the independent count of the decoder + output-layer FLOPs, 6 per weight and token in training."""
    from llamapipe.model.llama import LlamaConfig, LlamaModel
    model = LlamaModel(LlamaConfig(num_layers=shape["layers"], hidden_size=shape["hidden"],
                                   ffn_hidden_size=shape["ffn"], num_attention_heads=shape["heads"],
                                   num_query_groups=shape["groups"], vocab_size=vocab,
                                   max_position_embeddings=shape["seq"]))
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("embedding"))


@pytest.mark.parametrize("vocab", [256, 1024])
def test_iteration_flops_match_the_model_weights_plus_attention(vocab):
    shape = dict(bp.SHAPE, layers=2, hidden=64, ffn=172, heads=4, groups=2, seq=32, m=3)
    tokens = shape["mbs"] * shape["m"] * shape["seq"]
    attention = 3 * tokens * shape["layers"] * 4 * shape["seq"] * shape["hidden"]   # QK^T and PV, whole s x s
    expected = 6 * tokens * _matmul_weights(vocab, shape) + attention
    assert bp.iteration_flops(vocab, shape) == pytest.approx(expected, rel=1e-12)


def test_the_issue_shape_costs_what_the_issue_says():
    """V/h = 32 puts the output layer at a sizeable share of the model: 2 h V against the 8 layers' matmuls."""
    head = 6 * 2 * 8 * 256 * 256 * 8192
    assert bp.iteration_flops(8192) - bp.iteration_flops(256) == pytest.approx(head * (8192 - 256) / 8192)
    per_layer_token = 2 * 256 * (256 + 2 * 128) + 2 * 256 * 256 + 6 * 256 * 688 + 4 * 256 * 256   # by hand
    assert bp.iteration_flops(256) == 3 * 4096 * (8 * per_layer_token + 2 * 256 * 256)


def _row(case, vocab=256, iter_s=1.5, loss=5.55, rounds=(1.4, 1.6)):
    return {"case": case, "vocab": vocab, "iter_s": iter_s, "spread_s": [min(rounds), max(rounds)],
            "rounds_s": list(rounds), "gflops_per_iter": 48.0, "first_loss": loss, "ln_vocab": math.log(vocab),
            "body": bp.BODY[bp.framework(case)], "patches": []}


def test_markdown_table_has_one_row_per_case_with_the_same_columns():
    rows = [_row("ours-zbv"), _row("megatron-1f1b", loss=None),
            {"case": "deepspeed-1f1b", "vocab": 256, "error": "deepspeed-1f1b: deepspeed is not importable"}]
    lines = bp.markdown_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert len({ln.count("|") for ln in lines}) == 1, lines
    assert "| 256 | ours-zbv | 1,500 (1,400-1,600) | 48.0 | 32.00 | 5.550 (5.545) |" in lines[2]
    assert "n/a" in lines[3] and "not run: deepspeed-1f1b: deepspeed is not importable" in lines[4]


def test_missing_peer_gets_one_line_naming_the_case_and_module():
    assert bp.missing_reason("ours-auto", find_spec=lambda name: None) is None
    assert bp.missing_reason("torch-zbv", find_spec=lambda name: object()) is None
    why = bp.missing_reason("deepspeed-1f1b", find_spec=lambda name: None)
    assert why.startswith("deepspeed-1f1b: deepspeed is not importable") and "\n" not in why and "[peers]" in why

    def broken(name):
        raise ModuleNotFoundError(f"No module named '{name.split('.')[0]}'")
    assert "megatron.core" in bp.missing_reason("megatron-interleaved", find_spec=broken)


def test_a_peer_that_cannot_import_is_a_row_with_its_reason_not_a_launch(monkeypatch):
    monkeypatch.setattr(bp, "missing_reason", lambda case: f"{case}: deepspeed is not importable from x")
    monkeypatch.setattr(bp, "run_case", lambda *a: pytest.fail("a missing peer must not be launched"))
    assert bp.measure(["deepspeed-1f1b"], 256, rounds=2, iters=6, warmup=4) == [
        {"case": "deepspeed-1f1b", "vocab": 256, "error": "deepspeed-1f1b: deepspeed is not importable from x"}]


def test_one_line_picks_the_last_error_line():
    out = "loading\nTraceback (most recent call last):\n  File x\nRuntimeError: gloo timed out\n[rank1] exiting\n"
    assert bp.one_line(out) == "RuntimeError: gloo timed out"
    assert bp.one_line("just this\n\n") == "just this"
    assert bp.one_line("") == "no output"


def test_comparisons_and_loss_check_and_section():
    rows = [_row("ours-zbv", rounds=(1.0, 1.2)), _row("torch-1f1b", rounds=(1.25, 1.2)),
            _row("deepspeed-1f1b", iter_s=1.4, rounds=(1.5, 1.3)), _row("torch-zbv", iter_s=0.9, rounds=(0.9, 0.9)),
            _row("ours-1f1b", loss=5.60), _row("megatron-1f1b", loss=5.70),
            _row("ours-auto", vocab=8192, rounds=(2.0, 2.0)), _row("megatron-1f1b", vocab=8192, rounds=(2.5, 2.5))]
    got = bp.comparisons(rows)
    # balanced: the fastest peer 1F1B by median is deepspeed (1.4 s; torch-zbv is faster but not a 1F1B)
    assert got[0] == {"vocab": 8192, "ours": "ours-auto", "peer": "megatron-1f1b", "ratio": 0.8, "spread": [0.8, 0.8]}
    assert got[1]["peer"] == "deepspeed-1f1b" and got[1]["ratio"] == pytest.approx((1.0 / 1.5 + 1.2 / 1.3) / 2)
    bad = bp.loss_check(rows)
    assert len(bad) == 1 and bad[0].startswith("V=256 megatron-1f1b: first loss 5.7000")
    text = bp.section({"args": {"rounds": 2, "iters": 5, "warmup": 3}, "rows": rows, "comparisons": got,
                       "loss_check": bad})
    assert text.startswith("## Beside the peers\n") and "--rounds 2 --iters 5 --warmup 3" in text
    assert "ours-auto / megatron-1f1b = 0.800" in text and "megatron-1f1b: first loss" in text


# --- where the time goes (--timers) and the synthetic mode (--pp 4 --synthetic) ---

from benchmarks import peers_timers  # noqa: E402

_LOG = """[2026-11-29 10:49:26] notice: --pipeline-model-parallel-layout auto chose 'Et*4|t*4L' (layers 4/4)
[2026-11-29 10:49:33] times across ranks (ms):
    forward-backward ................................: rank 0: 2185.10, rank 1: 2230.42
    compute .........................................: rank 0: 1000.00, rank 1: 900.00
    communication ...................................: rank 0: 20.00, rank 1: 6.00
    idle ............................................: rank 0: 100.00, rank 1: 300.00
    forward-compute .................................: rank 0: 300.00, rank 1: 280.00
per-rank time per iteration (ms): rank 0: compute 1000.0, communication 20.0, idle 100.0 (bubble 8.9%)
[2026-11-29 10:49:33] iteration      1/     3 | elapsed time per iteration (ms): 2732.3
[2026-11-29 10:49:35] auto schedule: F=59.02 ms B=74.58 ms W=50.07 ms comm=0.985 ms -> auto: simulated bubble 5.6%
[2026-11-29 10:49:35] times across ranks (ms):
    compute .........................................: rank 0: 1200.00, rank 1: 1100.00
    communication ...................................: rank 0: 30.00, rank 1: 10.00
    idle ............................................: rank 0: 200.00, rank 1: 100.00
    forward-compute .................................: rank 0: 400.00, rank 1: 380.00
[2026-11-29 10:49:35] iteration      2/     3 | elapsed time per iteration (ms): 1734.1
"""


def test_timer_blocks_are_read_per_rank_and_averaged_after_the_warmup():
    blocks = peers_timers.parse_blocks(_LOG)
    assert len(blocks) == 2 and blocks[0]["forward-backward"] == [2185.10, 2230.42]
    assert blocks[1] == {"compute": [1200.0, 1100.0], "communication": [30.0, 10.0], "idle": [200.0, 100.0],
                         "forward-compute": [400.0, 380.0]}
    assert peers_timers.per_rank(blocks, warmup=1)[1]["idle"] == 100.0
    both = peers_timers.per_rank(blocks, warmup=0)
    assert both[0]["compute"] == pytest.approx(1100.0) and both[1]["forward-compute"] == pytest.approx(330.0)
    assert peers_timers.per_rank(blocks, warmup=2) == []
    choice = peers_timers.auto_choice(_LOG)
    assert choice[0].startswith("notice: --pipeline-model-parallel-layout auto chose 'Et*4|t*4L'")
    assert choice[1].startswith("auto schedule: F=59.02 ms") and len(choice) == 2


def test_breakdown_table_and_busy_share():
    assert peers_timers.busy_share([9.0, 0.5, 0.5], [9.0, 1.0, 1.0], warmup=1) == 0.5
    rows = [dict(_row("ours-auto"), timers=[{"compute": 900.0, "communication": 30.0, "idle": 70.0,
                                              "forward-compute": 300.0}]),
            dict(_row("torch-zbv"), busy=[0.8, 0.75])]
    lines = peers_timers.breakdown_table(rows).splitlines()
    assert len(lines) == 2 + 1 + 2 and len({ln.count("|") for ln in lines}) == 1
    assert lines[2].startswith("| 256 | ours-auto | 0 | 1,000 | 300 | 0 | 0 | 900 | 30 | 70 | 90% |")
    assert lines[4].endswith("| 75% |")


def test_synthetic_ideal_is_each_rank_busy_for_its_layers():
    # p = 4: 2 of the 8 layers a rank, 8 microbatches, F + B + W = 3 x 10 ms a layer
    assert bp.synthetic_ideal_s(4, 10.0) == pytest.approx(8 * 2 * 3 * 0.010)


@pytest.mark.parametrize("argv, says", [(["--pp", "64"], "--pp 64 on"), (["--pp", "3", "--synthetic"], "--pp 3"),
                                        (["--synthetic", "--sleep-ms", "0"], "--sleep-ms 0")])
def test_bad_combinations_get_one_line(argv, says, capsys):
    with pytest.raises(SystemExit):
        bp.main(argv)
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.slow
def test_synthetic_mode_runs_the_frameworks_and_states_what_it_is(tmp_path, monkeypatch):
    """Plumbing, end to end on sleeping stages at p = 2 (the smallest launch): ours through our runtime gives a row
    near the ideal (one launch keeps this short; the peers' synthetic paths run in the benchmark); a peer that
    cannot run is a row with its reason; the docs section says the numbers are synthetic."""
    import json
    real_missing = bp.missing_reason
    monkeypatch.setattr(bp, "missing_reason", lambda case: "deepspeed-1f1b: deepspeed is not importable from x"
                        if case.startswith("deepspeed") else real_missing(case))
    out = tmp_path / "syn.json"
    assert bp.main(["--pp", "2", "--synthetic", "--sleep-ms", "2", "--cases", "ours-zbv",
                    "deepspeed-1f1b", "--rounds", "1", "--iters", "3", "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["case"]: r for r in result["rows"]}
    assert rows["deepspeed-1f1b"]["error"].startswith("deepspeed-1f1b: deepspeed is not importable")
    ideal = bp.synthetic_ideal_s(2, 2.0)
    for case in ("ours-zbv",):
        assert rows[case]["synthetic"] is True and rows[case]["pp"] == 2 and rows[case]["ideal_s"] == ideal
        # a schedule cannot beat every rank sleeping its own work; a working one is far from 3x it
        assert ideal * 0.98 <= rows[case]["iter_s"] <= 3 * ideal + 0.5, rows[case]
        assert len(rows[case]["busy"]) == 2
    text = (tmp_path / "syn.md").read_text()
    assert "synthetic stages (SLEEPS, not the model)" in text and "--pp 2 --synthetic --sleep-ms 2" in text
    assert "not run: deepspeed-1f1b" in text
