"""/dashboard: one self-contained page (index.html + dashboard.js, shipped in the package:
no CDN, no build step) that polls GET /dashboard/api/snapshot every second and draws the
fleet: per model and class the request rate, errors, latency percentiles, queue depth,
KV-cache use, prefix-cache hit rate and tokens/s; replicas with pool, state and health;
migrations and replica events; charts of the last five minutes.

The page and its script are static and hold no data, so they load without credentials;
the snapshot is behind the server's API key like /v1 and /metrics (the page asks for the
key and sends it as a Bearer header). It is read-only.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from fleetserve.entrypoints.openai.dashboard.snapshot import ServiceView, Snapshots
from fleetserve.metrics import ServerMetrics

# Static assets: open paths of the server (no data in them).
DASHBOARD_ASSETS = ("/dashboard", "/dashboard/dashboard.js")
DASHBOARD_SNAPSHOT = "/dashboard/api/snapshot"
# Everything the page needs comes from this server; it may not be framed by another site.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'"
)
_STATIC_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def dashboard_router(metrics: ServerMetrics, services: Iterable[ServiceView]) -> APIRouter:
    router = APIRouter()
    snapshots = Snapshots(metrics, services)
    page, script = _asset("index.html"), _asset("dashboard.js")

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_STATIC_HEADERS)

    @router.get("/dashboard/dashboard.js", include_in_schema=False)
    async def dashboard_script() -> Response:
        return Response(
            script, media_type="text/javascript; charset=utf-8", headers=_STATIC_HEADERS
        )

    @router.get(DASHBOARD_SNAPSHOT)
    async def dashboard_snapshot() -> Response:
        return JSONResponse(snapshots.take(), headers={"Cache-Control": "no-store"})

    return router
