"""/docs works offline: Swagger UI's assets are served by the app (from a Python package), the
page has the same security headers as the other pages, and a browser that reaches nothing but
the control plane renders the API in it."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from covey.testing.plane import World
from harness.act.browser import chromium


async def test_the_docs_page_and_its_assets_come_from_the_app(world: World) -> None:
    page = await world.anonymous.get("/docs")
    assert page.status_code == 200, page.text
    csp = page.headers["content-security-policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "frame-ancestors 'none'",
                      "connect-src 'self'"):
        assert directive in csp, csp
    assert "unsafe-inline" not in csp and "http" not in csp, csp
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    # Nothing from elsewhere, and no inline script for the policy to have to allow.
    assert "//" not in re.sub(r"<!doctype[^>]*>", "", page.text), page.text
    assert not re.search(r"<script>(?!</script>)", page.text), page.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert {"/docs/static/swagger-ui-bundle.js", "/docs/static/swagger-ui.css",
            "/docs/static/docs.js"} <= set(assets), assets
    for asset in assets:
        r = await world.anonymous.get(asset)
        assert r.status_code == 200, (asset, r.status_code)
        assert r.headers["x-content-type-options"] == "nosniff"
        kind = {"js": "text/javascript", "css": "text/css", "png": "image/png"}
        assert r.headers["content-type"].startswith(kind[asset.rsplit(".", 1)[1]]), asset
    assert (await world.anonymous.get("/docs/static/../../app.py")).status_code == 404
    assert (await world.anonymous.get("/docs/static/index.html")).status_code == 404
    assert (await world.anonymous.get("/redoc")).status_code == 404  # it would need a CDN


def _render(url: str) -> tuple[int, list[dict[str, Any]], str]:
    with chromium(offline=True) as driver:
        driver.implicitly_wait(20)
        driver.get(f"{url}/docs")
        operations = driver.find_elements("css selector", ".opblock")
        title = driver.find_element("css selector", ".info .title").text
        return len(operations), driver.get_log("browser"), title


async def test_a_browser_offline_renders_the_api(world: World) -> None:
    operations, console, title = await asyncio.to_thread(_render, world.plane.url)
    severe = [entry for entry in console if entry["level"] == "SEVERE"]
    assert not severe, severe  # a refused script or style, a failed request
    assert title.startswith("covey"), title
    paths = len((await world.anonymous.get("/openapi.json")).json()["paths"])
    assert operations >= paths, (operations, paths)
