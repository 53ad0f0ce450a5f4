"""Optimizer package: AdamW with fp32 master weights, loss scaling, clipping, ZeRO-1, and the LR schedule."""
from llamapipe.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from llamapipe.core.optimizer.lr_scheduler import OptimizerParamScheduler
from llamapipe.core.optimizer.optimizer import Optimizer, StepResult, build_optimizer

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "Optimizer", "OptimizerParamScheduler", "StepResult",
           "build_grad_scaler", "build_optimizer"]
