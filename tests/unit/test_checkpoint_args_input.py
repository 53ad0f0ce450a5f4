"""--use-checkpoint-args on checkpoints it cannot take arguments from: one line, no traceback (issue 51)."""
from __future__ import annotations

import json

import pytest

from llamapipe.training.checkpointing import catalog
from tests.unit.test_checkpoint_integrity import save
from tests.unit.test_one_line_errors import error_line

TINY = ["--mock-data", "--model", "tiny"]


def _with_model_config(tmp_path, **edit) -> str:
    """A checkpoint whose metadata.json records `edit` as its model_config (re-sealed, so it verifies)."""
    save(tmp_path, 1)
    path = tmp_path / "iter_0000001" / catalog.METADATA
    meta = json.loads(path.read_text())
    meta["model_config"] = edit["model_config"] if "model_config" in edit else {**meta["model_config"], **edit}
    path.write_text(json.dumps(catalog.seal(meta)))
    return str(tmp_path)


@pytest.mark.parametrize("edit,says", [
    (dict(model_config={}), "has no model_config num_attention_heads; give the model's flags without "
                            "--use-checkpoint-args"),
    (dict(norm_epsilon="abc"), "records model_config norm_epsilon 'abc', not a finite number; "),
    (dict(num_layers="2"), "records model_config num_layers '2', not a finite integer; "),
    (dict(rope_theta=float("nan")), "records model_config rope_theta nan, not a finite number; "),
])
def test_a_checkpoint_model_config_that_cannot_be_taken_is_one_line(tmp_path, capsys, edit, says):
    """Before: `model_config: {}` raised KeyError; strings a TypeError in the argument checks."""
    load = _with_model_config(tmp_path, **edit)
    capsys.readouterr()
    line = error_line(TINY + ["--load", load, "--use-checkpoint-args"], capsys)
    assert line.startswith(f"--use-checkpoint-args: {tmp_path / 'iter_0000001' / catalog.METADATA} ") and says in line


def test_a_megatron_layout_load_is_said_once_as_unreadable(tmp_path, capsys):
    """Before: "no checkpoint in --load yet" (a notice) and then "holds checkpoints but none is usable"; since
    issue 49 the args come from the Megatron save, and a file there that is not one is one line."""
    (tmp_path / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")
    (tmp_path / catalog.TRACKER).write_text("10\n")
    line = error_line(TINY + ["--load", str(tmp_path), "--use-checkpoint-args"], capsys)
    assert line.startswith(f"--use-checkpoint-args: {tmp_path}/iter_0000010/mp_rank_00/model_optim_rng.pt is not "
                           "a readable Megatron checkpoint file (")
