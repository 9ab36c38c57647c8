"""The transformers runtime: a Hugging Face model in torch, measured token by token (the engine), with
its caches, live conversions and their transaction, loading, kernels, the allocator's peak and the
quantized backends prepared off the token path. ``runtime`` puts it behind the seam."""
