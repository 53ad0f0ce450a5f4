"""Optimizer package: AdamW with fp32 master weights, loss scaling, clipping, ZeRO-1, and the LR schedule."""
from core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from core.optimizer.lr_scheduler import OptimizerParamScheduler
from core.optimizer.optimizer import Optimizer, StepResult, build_optimizer

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "Optimizer", "OptimizerParamScheduler", "StepResult",
           "build_grad_scaler", "build_optimizer"]
