"""Learning-rate schedule: linear warmup from 0, then constant, linear or cosine decay to min_lr.

Follows Megatron-LM's `OptimizerParamScheduler.get_lr` formulas and its units: an iteration-based run
(--train-iters) counts optimizer steps, a sample-based run (--train-samples) counts consumed samples, so
its warmup and decay (--lr-warmup-samples, --lr-decay-samples) follow the data seen, also while
--rampup-batch-size grows the batch. --lr-warmup-fraction sets the warmup to that share of the decay
span in either unit. One `step(increment)` per successful optimizer update (increment: 1, or the step's
global batch size when counting samples). Iteration 1 runs at `get_lr()` of step 0 (0 during warmup), as
in Megatron. A param group marked `decoupled_lr` (the embedding and output layer under Megatron's
--decoupled-lr) follows the same warmup and decay between its own peak and floor (decoupled_lr,
decoupled_min_lr, which defaults to min_lr), as Megatron's per-group max_lr / min_lr do.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from llamapipe.core.config import ConfigError, OptimizerConfig

DECAY_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Sets `lr` on every param group of `optimizer` from the number of steps taken so far."""

    def __init__(self, optimizer: Any, opt_cfg: OptimizerConfig, train_iters: int,
                 train_samples: Optional[int] = None) -> None:
        if opt_cfg.lr_decay_style not in DECAY_STYLES:
            raise ConfigError(f"lr_decay_style {opt_cfg.lr_decay_style} is not one of {', '.join(DECAY_STYLES)}",
                              "lr_decay_style")
        self.optimizer = optimizer
        self.max_lr = float(opt_cfg.lr)
        self.min_lr = float(opt_cfg.min_lr)
        decoupled = opt_cfg.decoupled_lr is not None
        self.decoupled_max_lr = float(opt_cfg.decoupled_lr) if decoupled else None
        self.decoupled_min_lr = (float(opt_cfg.decoupled_min_lr if opt_cfg.decoupled_min_lr is not None
                                       else opt_cfg.min_lr) if decoupled else None)
        self.counts_samples = train_samples is not None
        unit = "samples" if self.counts_samples else "iters"
        given_decay = opt_cfg.lr_decay_samples if self.counts_samples else opt_cfg.lr_decay_iters
        self.lr_decay_steps = int(given_decay if given_decay is not None else
                                  train_samples if self.counts_samples else train_iters)
        # attribute -> (the config field that set it here, what it is), for the resume check in load_state_dict
        self._fields = {"max_lr": ("lr", "learning rate"), "min_lr": ("min_lr", "minimum learning rate"),
                        "lr_decay_style": ("lr_decay_style", "decay style"),
                        "lr_decay_steps": (f"lr_decay_{unit}" if given_decay is not None else f"train_{unit}",
                                           f"decay length in {unit}")}
        if decoupled:
            self._fields.update(decoupled_max_lr=("decoupled_lr", "embedding and output layer's learning rate"),
                                decoupled_min_lr=("decoupled_min_lr", "embedding and output layer's minimum "
                                                                      "learning rate"))
        if opt_cfg.lr_warmup_fraction is not None:
            self.lr_warmup_steps = opt_cfg.lr_warmup_fraction * self.lr_decay_steps
            warmup_field = "lr_warmup_fraction"
            warmup_said = f"{warmup_field} {opt_cfg.lr_warmup_fraction:g} ({self.lr_warmup_steps:g} {unit})"
        else:
            self.lr_warmup_steps = int(opt_cfg.lr_warmup_samples if self.counts_samples else opt_cfg.lr_warmup_iters)
            warmup_field = f"lr_warmup_{unit}"
            warmup_said = f"{warmup_field} {self.lr_warmup_steps}"
        self._fields["lr_warmup_steps"] = (warmup_field, f"warmup length in {unit}")
        self.lr_decay_style = opt_cfg.lr_decay_style
        if self.lr_decay_style != "constant" and self.lr_warmup_steps > self.lr_decay_steps:
            raise ConfigError(f"{warmup_said} is larger than the decay length (lr_decay_{unit} or train_{unit}) "
                              f"{self.lr_decay_steps}", warmup_field, f"lr_decay_{unit}", f"train_{unit}")
        self.num_steps = 0
        self.step(0)

    def get_lr(self, num_steps: Optional[int] = None, decoupled: bool = False) -> float:
        """Learning rate after `num_steps` updates (default: the current step count); `decoupled`: of the
        embedding and output layer under --decoupled-lr."""
        n = self.num_steps if num_steps is None else num_steps
        max_lr, min_lr = (self.decoupled_max_lr, self.decoupled_min_lr) if decoupled else (self.max_lr, self.min_lr)
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return max_lr * n / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        decay_ratio = (n - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        assert 0.0 <= decay_ratio <= 1.0, decay_ratio
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int = 1) -> float:
        """Advance the step count (by the step's global batch size when counting samples) and write the new
        learning rate into the optimizer; returns it."""
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(decoupled=True) if group.get("decoupled_lr") else lr
        return lr

    def state_dict(self) -> dict:
        decoupled = {"decoupled_max_lr": self.decoupled_max_lr, "decoupled_min_lr": self.decoupled_min_lr}
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "lr_warmup_steps": self.lr_warmup_steps, "lr_decay_steps": self.lr_decay_steps,
                "lr_decay_style": self.lr_decay_style, **(decoupled if self.decoupled_max_lr is not None else {})}

    def load_state_dict(self, state: dict, *, override: bool = False, use_checkpoint: bool = False) -> None:
        """Resume the step count, with Megatron's rule for the schedule's shape (lr, min-lr, warmup, decay
        length and style): `override` keeps the command line's, `use_checkpoint` takes the checkpoint's, and
        with neither a difference that changes a learning rate is a ConfigError naming the config field and both
        values (`override`, `use_checkpoint`: the config's override_opt_param_scheduler and
        use_checkpoint_opt_param_scheduler)."""
        choices = ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler")
        if override and use_checkpoint:
            raise ConfigError(f"{choices[0]} and {choices[1]} cannot be used together", *choices)
        # under a constant style on both sides the decay length and min-lr set no learning rate, so a
        # difference cannot make the schedule drift (Megatron compares them anyway)
        constant = self.lr_decay_style == state.get("lr_decay_style") == "constant"
        inert = ("lr_decay_steps", "min_lr", "decoupled_min_lr") if constant else ()
        for name, (field, what) in ([] if override else self._fields.items()):
            if name not in state or state[name] == getattr(self, name) or name in inert:
                continue
            if not use_checkpoint:
                raise ConfigError(f"{field} gives the {what} {getattr(self, name)} but the checkpoint's schedule has "
                                  f"{state[name]}; pass {choices[0]} to keep the command line's schedule or "
                                  f"{choices[1]} to take the checkpoint's", field, *choices)
            setattr(self, name, state[name])
        self.num_steps = 0
        self.step(int(state["num_steps"]))
