"""Data pipeline: sentencepiece tokenizer, RedPajama readers, Megatron .bin/.idx files, GPT samples, DP sampler.

The training loop needs only `data.sampler.build_data_iterators`.
"""
