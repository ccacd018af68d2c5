"""Observability: provenance, metrics and logging helpers."""
