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
