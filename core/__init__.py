"""KV Scope core: model specs, prediction, generation, measurement, recordings. No Qt here."""

__version__ = "0.1.0"
