"""The built-in live dashboard at /dashboard (see router.py)."""

from fleetserve.entrypoints.openai.dashboard.router import (
    DASHBOARD_ASSETS,
    DASHBOARD_SNAPSHOT,
    dashboard_router,
)

__all__ = ["DASHBOARD_ASSETS", "DASHBOARD_SNAPSHOT", "dashboard_router"]
