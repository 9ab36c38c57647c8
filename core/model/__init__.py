"""The model description: ``ModelSpec`` and its sources (Hugging Face configs, GGUF headers, presets,
the embedded model, the stores on this machine), the views of a spec (attention modes, cache strategies,
the states non-attention layers keep) and what the user asks of a run (settings, the run request)."""
