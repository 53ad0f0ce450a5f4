"""The llama family (arXiv 2302.13971, 2307.09288): its config and presets, the chunk every LLaMA-shaped family
builds from its spec, the HF `LlamaForCausalLM` adapter and the parameter and FLOP counts."""
from llamapipe.model.llama import counts, hf
from llamapipe.model.llama.config import PRESETS, LlamaConfig
from llamapipe.model.llama.model import LlamaModel
from llamapipe.model.spec import ModelFamily

FAMILY = ModelFamily.of("llama", LlamaConfig, LlamaModel, PRESETS, hf=hf, parameters=counts.model_parameters,
                        flops_per_token=counts.flops_per_token)

__all__ = ["FAMILY", "LlamaConfig", "LlamaModel", "PRESETS"]
