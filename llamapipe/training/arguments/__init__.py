"""Megatron-LM's flag names -> frozen per-concern configs; every check runs before any process group."""
from llamapipe.training.arguments.parser import build_parser, parse_args

__all__ = ["build_parser", "parse_args"]
