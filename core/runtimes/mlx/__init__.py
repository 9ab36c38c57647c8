"""MLX (Apple's array framework) through mlx-lm as a runtime: the third way a KV cache takes memory.

- ``predict``: the bytes of mlx-lm's caches (KVCache's 256-token steps, RotatingKVCache's window,
  QuantizedKVCache's codes, scales and biases), integers only, no MLX import.
- ``load``: the model folder mlx-lm loads (the embedded model, an MLX folder the installed-model scan finds).
- ``engine``: the model in mlx-lm, token by token, observing the cache from its arrays and the total from MLX's
  allocator; imported only where a run starts (it imports mlx).
"""
