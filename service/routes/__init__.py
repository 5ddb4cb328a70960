"""The HTTP routes, one router per API surface.

Adding a surface: write ``service/routes/<name>.py`` with a module-level ``router`` and add it to
``ROUTERS`` below; ``create_app`` includes every router in this list, in this order.
"""

from __future__ import annotations

from fastapi import APIRouter

from service.routes import docs, health, openai, playground, realtime, tts, voices

ROUTERS: tuple[APIRouter, ...] = (health.router, docs.router, tts.router, openai.router,
                                  voices.router, playground.router, realtime.router)
