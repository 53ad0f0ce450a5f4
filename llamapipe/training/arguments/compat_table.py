"""One Megatron-compatible flag that llamapipe accepts without effect or refuses (`CompatFlag`), a table of them
added to a parser with Megatron's arity, and how a given one is said in a notice or a refusal.

Shared by Megatron's own tables (`megatron_compat`) and the zero-bubble fork's (`zb_fork_flags`), which
`megatron_compat` adds to the parser and checks with its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union


@dataclass(frozen=True)
class CompatFlag:
    flag: str
    why: str                                    # notices: why it has no effect; refusals: why and what instead
    type: Optional[Callable] = None             # None: a switch; else it takes a value of this type
    nargs: Union[int, str, None] = None         # for a flag taking several values
    off: tuple = ()                             # refused flags: values that mean "off" and pass silently


def dest_of(flag: str) -> str:
    """argparse's attribute for `flag`: "--use-mcore-models" -> "use_mcore_models"."""
    return flag[2:].replace("-", "_")


def add_table(g, entries: tuple, prefix: str) -> None:
    """Each entry as a flag of argument group `g` with Megatron's arity, its reason as help."""
    for e in entries:
        text = prefix + e.why if not e.off else f"refused unless {' or '.join(map(str, e.off))} (off): {e.why}"
        if e.type is None:
            g.add_argument(e.flag, dest=dest_of(e.flag), action="store_true", help=text)
        else:
            g.add_argument(e.flag, dest=dest_of(e.flag), type=e.type, nargs=e.nargs, default=None, help=text)


def said(entry: CompatFlag, value) -> str:
    """The flag as given, with its value(s) unless it is a switch."""
    if entry.type is None:
        return entry.flag
    return f"{entry.flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"
