"""Data pipeline: tokenizers (sentencepiece, HF tokenizer.json, null), RedPajama readers, Megatron .bin/.idx files, GPT samples, DP sampler.

The training loop needs only `llamapipe.data.sampler.build_data_iterators`.
"""
