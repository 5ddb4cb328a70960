"""The speech tokenizer's Mimi encoder: reference audio -> 16 codes per 80 ms frame, on ggml."""
