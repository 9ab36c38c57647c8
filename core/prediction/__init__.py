"""Prediction from a spec alone, before anything loads: the formula and the predictor, parallelism,
serving capacity under vLLM's rules, llama.cpp's KV and compute buffers, and the OOM forecast."""
