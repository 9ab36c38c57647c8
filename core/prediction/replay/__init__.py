"""The activation replay: transformers' forward pass replayed allocation by allocation from a ModelSpec alone.

Shared blocks (``blocks``: embeddings, norms, rotary, MLPs, the cache's cat, the head; ``attention``: eager and
sdpa per kernel) and one recipe per family (``llama``, ``gemma``, ``neox``, ``olmo``), each a ``decoder.Decoder``
that overrides the hooks its modeling code changes. ``registry.RECIPES`` maps a model type to its recipe; a type
not there gets ``registry.DEFAULT``, Llama's layer, the nearest shape (``PrefillPeak.exact`` False). A new
architecture is a recipe class and one line of the registry."""
