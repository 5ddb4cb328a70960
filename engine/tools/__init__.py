"""Tooling that writes models: checkpoint conversion and synthetic test models.

Nothing here is loaded by a serving worker; the runtime reads GGUF files through
``engine.gguf_model`` and the schema in ``engine.gguf_schema``.
"""
