"""Building blocks of decoder-only transformers: norm, rotary embedding, attention, MLP."""
