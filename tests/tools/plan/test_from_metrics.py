"""`--from-metrics URL`: a real aiohttp server on 127.0.0.1 serving the sidecar's own
metrics text (prefix_sidecar.metrics.Metrics, fed usage as the relay feeds it)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from prefix_sidecar.metrics import Metrics
from prefix_sidecar_tools.harness import free_port
from prefix_sidecar_tools.plan.from_metrics import MetricsError, fetch, hit_rates, parse
from prefix_sidecar_tools.plan.scenario import Prefix, Scenario, Traffic
from tests.cli import run_cli


def sidecar_metrics_text(no_room: int = 0) -> bytes:
    metrics = Metrics()
    for _ in range(no_room):  # kv_events: a home pod lost a prefix it had no room for
        metrics.child(metrics.reprewarms, "no_room").inc()
    # 10 rules requests of 60,000 + 200 tokens: 9 fully cached prefixes, 1 cold
    for hit in [True] * 9 + [False]:
        metrics.record_usage("rules", 60_200, 60_000 if hit else 0, 16)
    # 10 script requests of 12,000 + 200: all cached
    for _ in range(10):
        metrics.record_usage("script", 12_200, 12_000, 16)
    return metrics.render()


class Server:
    """An aiohttp app on 127.0.0.1 in its own thread and loop (the CLI runs its own)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    body = sidecar_metrics_text()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    async def too_small(_: web.Request) -> web.Response:
        return web.Response(body=sidecar_metrics_text(no_room=3), content_type="text/plain")

    async def redirect(_: web.Request) -> web.Response:
        raise web.HTTPFound("/metrics")

    async def huge(_: web.Request) -> web.Response:
        return web.Response(body=b"#" * (5 * 1024 * 1024), content_type="text/plain")

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(3)
        return web.Response(text="")

    async def empty(_: web.Request) -> web.Response:
        return web.Response(text="# nothing served yet\n")

    app = web.Application()
    app.add_routes(
        [
            web.get("/metrics", metrics),
            web.get("/too-small", too_small),
            web.get("/redirect", redirect),
            web.get("/huge", huge),
            web.get("/slow", slow),
            web.get("/empty", empty),
        ]
    )
    running = Server(app)
    running.thread.start()
    assert running.ready.wait(10)
    yield running
    running.loop.call_soon_threadsafe(running.loop.stop)
    running.thread.join(10)


SCENARIO = Scenario(
    traffic=Traffic(
        prefixes=(Prefix("rules", 60_000, 0.5), Prefix("script", 12_000, 0.5)),
        query_tokens=200,
    )
)


def test_parse_and_rates_from_a_real_metrics_text() -> None:
    counts = parse(sidecar_metrics_text().decode())
    assert counts["rules"] == (602_000.0, 540_000.0)
    rates, overall = hit_rates(SCENARIO, counts)
    assert rates["rules"] == pytest.approx(0.9)
    assert rates["script"] == pytest.approx(1.0)
    assert overall == pytest.approx((540_000 + 120_000) / (600_000 + 120_000))


def test_fetch_over_http(server: Server) -> None:
    text = asyncio.run(fetch(server.url("/metrics")))
    assert "prefix_sidecar_cached_tokens_total" in text


@pytest.mark.parametrize(
    ("path", "message", "kwargs"),
    [
        ("/redirect", r"answered HTTP 302, not 200 \(no redirects\)", {}),
        ("/huge", "more than 1048576 bytes", {"max_bytes": 1 << 20}),
        ("/slow", "TimeoutError", {"timeout_s": 0.5}),
    ],
)
def test_fetch_is_bounded(server: Server, path: str, message: str, kwargs: dict) -> None:
    with pytest.raises(MetricsError, match=message):
        asyncio.run(fetch(server.url(path), **kwargs))


def plan_from(url: str, *more: str) -> subprocess.CompletedProcess[str]:
    """`prefix-sidecar plan` of SCENARIO's two prefixes, its hit rates from `url`."""
    done = run_cli(
        "plan",
        "--prefix", "rules:60000:0.5",
        "--prefix", "script:12000:0.5",
        "--slo-ms", "8000",
        "--from-metrics", url,
        "--samples", "5000",
        *more,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def test_cli_from_metrics(server: Server) -> None:
    done = plan_from(server.url("/metrics"), "--json")
    data = json.loads(done.stdout)
    prefixes = {p["name"]: p for p in data["scenario"]["traffic"]["prefixes"]}
    assert prefixes["rules"]["hit_rate"] == pytest.approx(0.9)
    assert prefixes["script"]["hit_rate"] == pytest.approx(1.0)
    assert data["scenario"]["routing"]["source"].startswith(server.url("/metrics"))
    assert "too small" not in done.stdout


def test_cli_from_metrics_says_when_the_pods_are_too_small_for_their_homes(
    server: Server,
) -> None:
    done = plan_from(server.url("/too-small"))
    assert "pods too small for the prefixes they are home to: 3 losses without room" in (
        done.stdout
    )
    assert "more KV per pod, or more pods" in done.stdout


def test_cli_from_metrics_with_nothing_served_exits_2(server: Server) -> None:
    done = run_cli("plan", "--from-metrics", server.url("/empty"))
    assert done.returncode == 2
    assert "the sidecar has served nothing yet" in done.stderr
    done = run_cli("plan", "--from-metrics", "file:///etc/passwd")
    assert done.returncode == 2
    assert "wants an http(s) URL" in done.stderr
