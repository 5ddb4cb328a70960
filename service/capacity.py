"""How many requests one server synthesizes at once: the denominator of the autoscaler's
utilisation, ``(running + waiting) / capacity`` (docs/deploy.md, "Scaling").

Exported as the gauge ``qtts_capacity``. It is the configured figure, not the live one: a
crashed worker must raise utilisation (and so scale out), never divide by zero.
"""

from __future__ import annotations

from service.settings import Settings


def capacity(settings: Settings) -> int:
    """Requests the server's workers can run at the same time (each up to ``max_batch``)."""
    return settings.workers * settings.max_batch
