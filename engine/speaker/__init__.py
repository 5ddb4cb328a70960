"""The speaker encoder of Base models: reference audio -> x-vector (ECAPA-TDNN on ggml)."""
