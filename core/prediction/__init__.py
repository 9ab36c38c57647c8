"""Prediction from a spec alone, before anything loads: the formula and the predictor, ``calc``'s figures and
tables, parallelism, serving capacity under vLLM's rules, llama.cpp's KV and compute
buffers, and the OOM forecast."""
