"""One module per tokenizer kind behind `llamapipe.data.tokenizer.build_tokenizer` (Megatron's --tokenizer-type)."""
