"""``/docs`` (Swagger UI) and ``/redoc``, served with no network: their JavaScript, CSS and icon
come from the ``fastapi-offline`` package's static folder, not from a CDN."""

from __future__ import annotations

import importlib.resources

from fastapi import APIRouter, HTTPException, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse, Response

router = APIRouter(include_in_schema=False)
ASSETS_URL = "/docs/assets"
_ASSETS = importlib.resources.files("fastapi_offline") / "static"
_TYPES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}


def _urls(request: Request) -> tuple[str, str]:
    """The OpenAPI document's URL and the assets' folder URL, behind any root path."""
    root = str(request.scope.get("root_path", ""))
    return f"{root}{request.app.openapi_url}", f"{root}{ASSETS_URL}"


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    openapi, assets = _urls(request)
    return get_swagger_ui_html(
        openapi_url=openapi, title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{assets}/swagger-ui-bundle.js",
        swagger_css_url=f"{assets}/swagger-ui.css", swagger_favicon_url=f"{assets}/favicon.png",
        oauth2_redirect_url=request.app.swagger_ui_oauth2_redirect_url,
        # no badge fetched from validator.swagger.io
        swagger_ui_parameters={"validatorUrl": None},
    )


@router.get("/docs/oauth2-redirect")
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    openapi, assets = _urls(request)
    return get_redoc_html(
        openapi_url=openapi, title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{assets}/redoc.standalone.js", redoc_favicon_url=f"{assets}/favicon.png",
        with_google_fonts=False,
    )


@router.get(ASSETS_URL + "/{name}")
async def asset(name: str) -> Response:
    media_type = _TYPES.get(name)
    if media_type is None:
        raise HTTPException(404, "Not Found")
    return Response((_ASSETS / name).read_bytes(), media_type=media_type,
                    headers={"Cache-Control": "public, max-age=86400"})
