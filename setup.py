"""llamapipe: Megatron-style LLaMA pretraining with TP/PP/VPP/DP and zero-bubble pipeline schedules."""
from setuptools import setup

setup(
    name="llamapipe",
    version="0.1.0",
    description="Megatron-style LLaMA pretraining with tensor, pipeline, virtual-pipeline and data "
                "parallelism and zero-bubble pipeline schedules",
    python_requires=">=3.9",
    packages=["core", "core.tensor_parallel", "core.pipeline_parallel", "core.optimizer", "model", "data"],
    py_modules=["pretrain_llama"],
    install_requires=[
        "torch>=2.5",  # F.rms_norm, SDPA enable_gqa
        "sentencepiece>=0.1.99",
        "datasets>=2.14",
        "numpy>=1.24",
        "tqdm>=4.60",
        "tensorboard>=2.10",
        "safetensors>=0.4",
        "matplotlib>=3.5",
        "pyarrow>=12",
    ],
    extras_require={"test": ["pytest>=7", "transformers>=4.40"]},
)
