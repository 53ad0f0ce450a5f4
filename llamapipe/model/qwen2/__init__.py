"""The qwen2 family: LLaMA's chunk with q/k/v biases (`model.py`), its config and presets, the HF
`Qwen2ForCausalLM` adapter."""
from llamapipe.model.qwen2 import hf
from llamapipe.model.qwen2.config import PRESETS, Qwen2Config
from llamapipe.model.qwen2.model import Qwen2Model, flops_per_token, model_parameters
from llamapipe.model.spec import ModelFamily

FAMILY = ModelFamily.of("qwen2", Qwen2Config, Qwen2Model, PRESETS, hf=hf, parameters=model_parameters,
                        flops_per_token=flops_per_token)

__all__ = ["FAMILY", "PRESETS", "Qwen2Config", "Qwen2Model"]
