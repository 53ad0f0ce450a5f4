"""Named RNG states so TP ranks draw consistent random numbers (Megatron's CudaRNGStatesTracker).

Inside `tracker.fork(name)` the default generator (CUDA's when available, else CPU's) is swapped for the
named state and swapped back afterwards, so the default stream is untouched. Megatron forks the
"model-parallel" state (different per TP rank) for dropout inside TP regions and leaves the default state
identical across TP ranks for replicated regions. LLaMA pretraining uses no dropout, so the model never
forks; the tracker exists for extensions and for checkpointing RNG state.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's offset between the default and the model-parallel seed


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Holds named generator states; `fork(name)` runs a block on one of them."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"RNG seed {seed} is already used by another tracked state")
        if name in self.states:
            raise ValueError(f"RNG state {name} already exists")
        self.seeds.add(seed)
        saved = _get_state()
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def reset(self) -> None:
        self.states, self.seeds = {}, set()

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states:
            raise ValueError(f"RNG state {name} was never added to the tracker")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int) -> None:
    """Seed the default stream with `seed` (same on TP ranks) and the tracked stream per TP rank."""
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
