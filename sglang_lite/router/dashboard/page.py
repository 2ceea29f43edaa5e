"""`GET /dashboard`: one self-contained page (its CSS, script and the vendored uPlot charting library inlined, so
it loads with no network access), and `GET /dashboard/data`: the JSON it polls every second."""

from __future__ import annotations

import functools
from pathlib import Path

from aiohttp import web

from ..proxy import json_error
from .watch import ClusterWatch

STATIC = Path(__file__).with_name("static")
# placeholder in dashboard.html -> the file whose text replaces it
INLINED = {
    "/*UPLOT_CSS*/": "uPlot.min.css",
    "/*DASHBOARD_CSS*/": "dashboard.css",
    "/*UPLOT_JS*/": "uPlot.iife.min.js",
    "/*DASHBOARD_JS*/": "dashboard.js",
}
ROUTES = ("/dashboard", "/dashboard/data")


@functools.cache
def page_html() -> str:
    html = (STATIC / "dashboard.html").read_text()
    for placeholder, name in INLINED.items():
        text = (STATIC / name).read_text()
        assert "</script" not in text and "</style" not in text, f"{name} cannot be inlined"
        assert placeholder in html, f"dashboard.html lacks {placeholder}"
        html = html.replace(placeholder, text)
    return html


class DashboardPage:
    def __init__(self, watch: ClusterWatch) -> None:
        self.watch = watch

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/dashboard", self.handle_page)
        app.router.add_get("/dashboard/data", self.handle_data)

    async def handle_page(self, request: web.Request) -> web.Response:
        return web.Response(
            text=page_html(), content_type="text/html", headers={"Cache-Control": "no-store"}
        )

    async def handle_data(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return json_error(400, "since must be a sample number (an integer)")
        return web.json_response(self.watch.snapshot(since), headers={"Cache-Control": "no-store"})
