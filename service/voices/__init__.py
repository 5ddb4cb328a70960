"""Cloned voices in the service: the store (SQLite or PostgreSQL), owners, and the voice routes'
helpers. The prompt itself is computed by a worker (service/worker.py), never here."""
