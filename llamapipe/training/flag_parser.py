"""argparse for every command line here: a mistyped flag gets the usage line and one error line naming the
closest known flag ("did you mean"), instead of argparse's usage of every flag (issue 33).

`pretrain_llama.py` and each `llamapipe` subcommand build a `FlagParser`; `closest` is the same suggestion for
other names (the `llamapipe` subcommands). As in Megatron, abbreviated flags are not accepted.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Optional, Sequence

__all__ = ["FlagParser", "closest", "unrecognized"]

_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class FlagParser(argparse.ArgumentParser):
    """argparse with a one-line usage, "did you mean" for unknown flags, and errors printed by rank 0 only.

    Unknown flags are reported before anything else (a missing required flag may be the mistyped one).
    """

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        parser, words = self._innermost(argv)
        unknown = parser.unknown_flags(words)
        if unknown:
            parser.error(unrecognized(unknown, parser.option_strings()))
        namespace, extras = self.parse_known_args(argv, namespace)
        if extras:
            self.error(unrecognized(extras, self.option_strings()))
        return namespace

    def _innermost(self, argv: list[str]) -> tuple["FlagParser", list[str]]:
        """The (sub)parser that reads the flags of `argv`, and those words: a subcommand's own flags follow it."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):   # argparse has no public accessor for it
                for i, word in enumerate(argv):
                    sub = action.choices.get(word)
                    if isinstance(sub, FlagParser):
                        return sub._innermost(argv[i + 1:])
                return self, []
        return self, argv

    def option_strings(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")]

    def unknown_flags(self, argv: Sequence[str]) -> list[str]:
        """The tokens before any `--` that argparse takes for flags (not negative numbers, no space) and that
        name none of ours."""
        known = {s for action in self._actions for s in action.option_strings}
        words = list(argv)
        words = words[:words.index("--")] if "--" in words else words
        return [w for w in words if w.startswith("-") and len(w) > 1 and not _NUMBER.match(w) and " " not in w
                and w.split("=", 1)[0] not in known]

    def format_usage(self) -> str:
        """One line whatever the number of flags: the program, its positionals, and where the flags are listed."""
        if self.usage is not None:
            return super().format_usage()
        positionals = " ".join(a.metavar or ("{" + ",".join(a.choices) + "}" if a.choices else a.dest.upper())
                               for a in self._actions if not a.option_strings)
        words = [self.prog] + ([positionals] if positionals else []) + ["[flags]   (--help lists every flag)"]
        return "usage: " + " ".join(words) + "\n"

    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def closest(name: str, known: Sequence[str]) -> Optional[str]:
    """The known name most like `name`, or None when none is close (difflib's ratio >= 0.6)."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return match[0] if match else None


def unrecognized(extras: Sequence[str], known: Sequence[str]) -> str:
    """'unrecognized argument --x; did you mean --y?' for each unknown flag (their values are not named)."""
    flags = [e for e in extras if e.startswith("-")] or list(extras)
    close = {flag: closest(flag.split("=", 1)[0], known) for flag in flags}
    if len(flags) == 1:
        flag = flags[0]
        return f"unrecognized argument {flag}" + (f"; did you mean {close[flag]}?" if close[flag] else "")
    said = [f"{flag} (did you mean {close[flag]}?)" if close[flag] else flag for flag in flags]
    return f"unrecognized arguments {', '.join(said)}"
