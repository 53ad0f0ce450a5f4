"""The qwen3 family: LLaMA's chunk with per-head q/k norms (`model.py`), its config and presets, the HF
`Qwen3ForCausalLM` adapter."""
from llamapipe.model.qwen3 import hf
from llamapipe.model.qwen3.config import PRESETS, Qwen3Config
from llamapipe.model.qwen3.model import Qwen3Model, flops_per_token, model_parameters
from llamapipe.model.spec import ModelFamily

FAMILY = ModelFamily.of("qwen3", Qwen3Config, Qwen3Model, PRESETS, hf=hf, parameters=model_parameters,
                        flops_per_token=flops_per_token)

__all__ = ["FAMILY", "PRESETS", "Qwen3Config", "Qwen3Model"]
