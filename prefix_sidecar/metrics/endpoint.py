"""The metrics port: /metrics as Prometheus text, and the probes beside it.

aiohttp, because the port also serves /livez and /readyz (server.common.probes) and a
scrape is rendered off the event loop (Metrics.render_off_loop).
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from prefix_sidecar.metrics.registry import Metrics


async def start_metrics_server(
    metrics: Metrics, host: str, port: int, routes: Iterable[web.RouteDef] = ()
) -> web.AppRunner:
    """Serve /metrics, plus `routes` (the probes) on the same port."""

    async def handle(_: web.Request) -> web.Response:
        body = await metrics.render_off_loop()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
