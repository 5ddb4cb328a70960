"""``GET /playground``: a page to try the service in a browser (service/static/playground/).

Plain HTML, CSS and JavaScript shipped in the package: no CDN, no build step, works offline.
The page calls the public API like any client (``/v1/models``, ``/v1/audio/voices``,
``POST /v1/audio/speech`` with ``stream_format: "sse"`` and PCM), so it needs no route of its
own beyond its files. It is outside the API key gate; the API calls it makes are not.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.exceptions import HTTPException

STATIC = Path(__file__).resolve().parents[1] / "static" / "playground"
# The page's files and their types: nothing else under the folder is served.
ASSETS = {
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
    "meter.js": "text/javascript; charset=utf-8",
}
# Everything from this origin only (the proof that nothing is fetched from elsewhere);
# blob: for the download link.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "media-src 'self' blob:; connect-src 'self'; worker-src 'self'; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

router = APIRouter()


@router.get("/playground", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                        headers=HEADERS)


@router.get("/playground/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(404, f"no playground file {name!r}")
    return FileResponse(STATIC / name, media_type=media_type, headers=HEADERS)
