"""The floor every other room stands on: the error hierarchy, safe text for terminals, and the
collector's long-lived objects. Imports nothing else of KV Scope."""
