"""The router's live cluster page: per server and DP rank loads, the p2c study's balance figures and the router's
latency while it runs (`GET /dashboard`; its data at `GET /dashboard/data`). See docs/router.md."""

from .page import ROUTES, DashboardPage, page_html
from .watch import ClusterWatch

__all__ = ["ROUTES", "ClusterWatch", "DashboardPage", "page_html"]
