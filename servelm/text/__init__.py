"""Text side of a model: tokenizer, chat template, generation defaults, streaming detokenizer."""
