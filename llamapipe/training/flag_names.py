"""The library's errors worded as command-line flags: core says "pp_size 3 ..." (`core.config.ConfigError`, which
lists the config fields it names), the user reads "--pipeline-model-parallel-size 3 ...".

Why here: the library knows no flags (docs/design.md section 1); training/ turns flags into configs, so it turns
the configs' field names back into flags wherever a library error reaches the user: the argument checks re-raise
it worded as flags (`worded_as_flags`), a failed rank's one-line error and the tools word it when they print
(`flag_message`). A field's flag is the field with dashes unless `FLAGS` says otherwise.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterable, Iterator

from llamapipe.core.config import ArgumentError, ConfigError

FLAGS = {   # config field (or library argument) -> its flag, where that is not "--" + the field with dashes
    "tp_size": "--tensor-model-parallel-size",
    "pp_size": "--pipeline-model-parallel-size",
    "cp_size": "--context-parallel-size",
    "pipeline_layout": "--pipeline-model-parallel-layout",
    "first_stage_layers": "--decoder-first-pipeline-num-layers",
    "last_stage_layers": "--decoder-last-pipeline-num-layers",
    "account_for_embedding": "--account-for-embedding-in-pipeline-split",
    "account_for_loss": "--account-for-loss-in-pipeline-split",
    "override_opt_param_scheduler": "--override-opt_param-scheduler",        # Megatron's spelling
    "use_checkpoint_opt_param_scheduler": "--use-checkpoint-opt_param-scheduler",
    "seq_split_balance": "--seq1f1b-balance-method",
}
JOINED = {  # two fields said as one, "a/b", and the flags' shared spelling
    ("first_stage_layers", "last_stage_layers"): "--decoder-first/last-pipeline-num-layers",
}


def flag_of(field: str) -> str:
    """The flag that sets config field `field`: "global_batch_size" -> "--global-batch-size"."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def as_flags(text: str, fields: Iterable[str]) -> str:
    """`text` with each of `fields` (whole words, not inside a path) named by its flag."""
    fields = set(fields)
    for pair, flag in JOINED.items():
        if fields.issuperset(pair):
            text = text.replace("/".join(pair), flag)
    if not fields:
        return text
    names = "|".join(re.escape(f) for f in sorted(fields, key=len, reverse=True))
    return re.sub(rf"(?<![\w/.-])({names})(?![\w/-])", lambda match: flag_of(match[1]), text)


def flag_message(err: BaseException) -> str:
    """What the command line says for `err`: a library `ConfigError` with its fields named as flags, any other
    error as it is."""
    return as_flags(str(err), err.fields) if isinstance(err, ConfigError) else str(err)


@contextmanager
def worded_as_flags() -> Iterator[None]:
    """Re-raise a library `ConfigError` from the block as an `ArgumentError` worded in flags: what the argument
    checks promise (`training.arguments.parser.config_from_args`)."""
    try:
        yield
    except ConfigError as err:
        raise ArgumentError(flag_message(err)) from None
