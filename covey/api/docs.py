"""GET /docs: Swagger UI over the OpenAPI document, with every asset served by the app itself
from a Python package (swagger-ui-bundle-v2): it once came from a CDN, so /docs rendered blank
wherever the browser could not reach the internet, and it sent no frame or content-security
headers. Now it has the same headers as /administration's pages, and its content security
policy allows no script but the app's own files, nor any request but to the app.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response
from swagger_ui_bundle import swagger_ui_path

from covey.api.administration import page_headers

router = APIRouter(include_in_schema=False)
# Swagger UI styles some of its elements from its script and draws icons from data: URIs.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
       " connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
ASSETS = {  # name -> (folder, media type)
    "swagger-ui-bundle.js": (Path(str(swagger_ui_path)), "text/javascript"),
    "swagger-ui.css": (Path(str(swagger_ui_path)), "text/css"),
    "favicon-32x32.png": (Path(str(swagger_ui_path)), "image/png"),
    "docs.js": (Path(str(resources.files("covey") / "static")), "text/javascript"),
}
PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>covey API</title>
<link rel="icon" type="image/png" href="/docs/static/favicon-32x32.png">
<link rel="stylesheet" href="/docs/static/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/static/swagger-ui-bundle.js"></script>
<script src="/docs/static/docs.js"></script>
</body>
</html>
"""


@router.get("/docs", response_class=HTMLResponse)
async def docs() -> HTMLResponse:
    return HTMLResponse(PAGE, headers=page_headers(CSP))


@functools.cache
def _asset(name: str) -> bytes:
    folder, _ = ASSETS[name]
    return (folder / name).read_bytes()


@router.get("/docs/static/{name}")
async def docs_asset(name: str) -> Response:
    if name not in ASSETS:
        return JSONResponse({"error": "Not found", "hint": "No such file."}, 404)
    # Cached for a day: they change only with the installed package, and a page load
    # should not cost the control plane 1.5 MB of reading each time.
    return Response(_asset(name), media_type=ASSETS[name][1],
                    headers={"Cache-Control": "public, max-age=86400",
                             "X-Content-Type-Options": "nosniff"})
