"""Offline tools: checkpoint conversion and synthetic models (never used when serving)."""
