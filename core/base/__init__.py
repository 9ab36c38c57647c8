"""The floor every other room stands on: plain types every room shares (the error hierarchy, the ``Sample``),
safe text for terminals, and the collector's long-lived objects. Imports nothing else of KV Scope."""
