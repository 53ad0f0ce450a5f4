"""fp16 loss scaling: a constant scale (`--loss-scale`) or Megatron's dynamic scaler.

Dynamic rule (Megatron `DynamicGradScaler`): after `loss_scale_window` consecutive clean steps the scale
doubles and the hysteresis budget is refilled; every step with inf/NaN gradients resets the clean-step
count and spends one unit of hysteresis; once the budget is spent, each such step halves the scale
(never below `min_loss_scale`).
"""
from __future__ import annotations

from llamapipe.core.config import OptimizerConfig


class ConstantGradScaler:
    """A fixed loss scale; steps with inf/NaN gradients are still skipped."""

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        pass  # the flag, not the checkpoint, decides a constant scale


class DynamicGradScaler(ConstantGradScaler):
    """Grows the scale x2 after `growth_interval` clean steps, backs off x0.5 after `hysteresis` bad steps."""

    def __init__(self, initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5) -> None:
        super().__init__(initial_scale)
        assert min_scale > 0 and growth_interval > 0 and hysteresis > 0
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


def build_grad_scaler(opt_cfg: OptimizerConfig) -> ConstantGradScaler | None:
    """Constant scaler when --loss-scale is given (fp16/bf16), dynamic for fp16, none otherwise."""
    if not (opt_cfg.fp16 or opt_cfg.bf16):
        return None
    if opt_cfg.loss_scale is not None:
        return ConstantGradScaler(opt_cfg.loss_scale)
    if opt_cfg.fp16:
        return DynamicGradScaler(opt_cfg.initial_loss_scale, opt_cfg.min_loss_scale,
                                 opt_cfg.loss_scale_window, opt_cfg.hysteresis)
    return None
