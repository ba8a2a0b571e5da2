"""The Prometheus endpoint exposes the documented series; the upstream API key is sent as a
Bearer token and never logged."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from prefix_sidecar.v1 import router_pb2
from tests.api_key import KeySettings
from tests.fake_pod import start_site
from tests.server.conftest import collect, free_port, running_sidecar, sidecar_config, wait_serving

SECRET = "sk-prod-7c1e5b2a9d-do-not-log"


async def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> {sorted labels: value}, parsed with prometheus_client's own text parser."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    series: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            series.setdefault(sample.name, {})[labels] = sample.value
    return series


async def test_metrics_endpoint_exposes_the_documented_series(
    tmp_path: Path, pods: list[str]
) -> None:
    port = free_port()
    config = sidecar_config(tmp_path, pods, metrics_port=port)
    async with running_sidecar(config) as (_, stub):
        await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="rules", text="rule " * 2000, prewarm=True)
        )
        chunks = await collect(
            stub.Complete(router_pb2.CompleteRequest(prefix_name="rules", input="q", max_tokens=3))
        )
        backend = chunks[0].backend
        usage = chunks[-1].usage
        metrics = await scrape(port)

    def value(name: str, **labels: str) -> float:
        wanted = tuple(sorted(labels.items()))
        assert wanted in metrics.get(name, {}), f"{name}{labels} missing: {metrics.get(name)}"
        return metrics[name][wanted]

    requests = {
        "front": "grpc",
        "rpc": "Complete",
        "pool": "default",
        "backend": backend,
        "branch": "home",
    }
    assert value("prefix_sidecar_requests_total", **requests, status="OK") == 1
    assert value("prefix_sidecar_decision_seconds_count", front="grpc", rpc="Complete") == 1
    assert value("prefix_sidecar_ttft_seconds_count", front="grpc", backend=backend) == 1
    assert value("prefix_sidecar_in_flight", front="grpc", backend=backend) == 0
    assert value("prefix_sidecar_prompt_tokens_total", prefix="rules") == usage.prompt_tokens
    assert value("prefix_sidecar_cached_tokens_total", prefix="rules") == usage.cached_tokens > 0
    assert value("prefix_sidecar_completion_tokens_total", prefix="rules") == 3
    for url in pods:
        assert value("prefix_sidecar_backend_healthy", backend=url) == 1
        assert value("prefix_sidecar_backend_state", backend=url, state="serving") == 1
    assert value("prefix_sidecar_prewarm_total", backend=backend, result="warmed") == 1
    assert 0 < value("prefix_sidecar_cost_saving_ratio") < 1


async def test_organic_routing_exports_its_decisions_and_table(
    tmp_path: Path, pods: list[str]
) -> None:
    """Chats nobody registered, through the Chat RPC: each decision counted by its kind,
    the anchor table's entries per map; with the window instead, neither series."""
    port = free_port()
    config = sidecar_config(tmp_path, pods, metrics_port=port)
    system = ("system", "You are the returns desk of a shoe shop. " * 8)

    async def chat(*messages: tuple[str, str]) -> None:
        request = router_pb2.ChatRequest(
            messages=[router_pb2.ChatMessage(role=r, content=c) for r, c in messages],
            max_tokens=2,
        )
        await collect(stub.Chat(request))

    async with running_sidecar(config) as (_, stub):
        await chat(system, ("user", "Can I return worn shoes?"))  # a start
        await chat(system, ("user", "Can I return worn shoes?"), ("assistant", "No."),
                   ("user", "Even unworn?"))  # fmt: skip
        await chat(("user", "no system message at all"))  # nothing to anchor on
        metrics = await scrape(port)
    decisions = {
        dict(labels)["kind"]: value
        for labels, value in metrics["prefix_sidecar_organic_decisions_total"].items()
    }
    # One tenant of a new sidecar: a one-pod home set, so its start stays where it is.
    assert decisions == {
        "unanchored": 1,
        "later_turn": 1,
        "start_stayed": 1,
        "start_moved": 0,
        "start_far": 0,
        "later_followed": 0,
    }
    table = {
        dict(labels)["map"]: value
        for labels, value in metrics["prefix_sidecar_organic_table_entries"].items()
    }
    assert set(table) == {"blocks", "branch_points", "families"}
    assert table["families"] == 2 and table["blocks"] >= 2

    config = sidecar_config(tmp_path, pods, metrics_port=port, unregistered_routing="window")
    async with running_sidecar(config) as (_, stub):
        await chat(system, ("user", "Can I return worn shoes?"))
        metrics = await scrape(port)
    assert "prefix_sidecar_organic_decisions_total" not in metrics
    assert "prefix_sidecar_organic_table_entries" not in metrics


@contextlib.asynccontextmanager
async def recording_pod(headers: list[dict[str, str]]) -> AsyncIterator[str]:
    """A tiny OpenAI-compatible pod that records every request's headers (the emulator
    does not check API keys)."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def completions(request: web.Request) -> web.StreamResponse:
        headers.append(dict(request.headers))
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = [
            {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]},
            {
                "choices": [],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1},
            },
        ]
        for event in events:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    runner, base_url = await start_site(app, access_log=None)
    try:
        yield base_url
    finally:
        await runner.cleanup()


async def test_api_key_is_sent_as_bearer_and_never_logged(
    key_settings: KeySettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    values = key_settings(SECRET)
    headers: list[dict[str, str]] = []
    async with recording_pod(headers) as pod:
        config = sidecar_config(tmp_path, [pod], **values)
        async with running_sidecar(config) as (_, stub):
            await stub.RegisterPrefix(
                router_pb2.RegisterPrefixRequest(name="r", text="rules " * 50, prewarm=True)
            )
            chunks = await collect(
                stub.Complete(router_pb2.CompleteRequest(prefix_name="r", input="q"))
            )
    assert "".join(c.text for c in chunks) == "ok"
    assert len(headers) == 2  # the prewarm and the completion
    for seen in headers:
        assert seen["Authorization"] == f"Bearer {SECRET}"
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert "Complete prefix=r" in logged, "the request log line is missing"
    assert SECRET not in logged
    assert "rules rules" not in logged, "prompt text must not be logged"


async def test_a_pod_that_leaves_the_membership_leaves_the_metrics(
    tmp_path: Path, pods: list[str]
) -> None:
    port = free_port()
    backends = tmp_path / "backends.json"
    backends.write_text(json.dumps(pods), encoding="utf-8")
    config = sidecar_config(tmp_path, [], backends_file=str(backends), metrics_port=port)
    async with running_sidecar(config) as (_, stub):
        await wait_serving(stub, pods)
        before = await scrape(port)
        staging = tmp_path / "backends.tmp"
        staging.write_text(json.dumps(pods[:2]), encoding="utf-8")
        staging.replace(backends)
        await wait_serving(stub, pods[:2])
        after = await scrape(port)

    def backends_in(metrics: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> set[str]:
        return {
            dict(labels)["backend"]
            for name in ("prefix_sidecar_backend_healthy", "prefix_sidecar_backend_state")
            for labels in metrics.get(name, {})
        }

    assert backends_in(before) == set(pods)
    # A removed pod reported as healthy and serving forever would mislead every dashboard.
    assert backends_in(after) == set(pods[:2])
