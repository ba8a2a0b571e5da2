"""The HTTP face of one emulated pod: vLLM's endpoints plus /admin for tests and benches.

vLLM endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, POST /tokenize, GET /metrics, GET /version, POST /reset_prefix_cache; with
--runtime-lora-updating POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters.py).
Admin: GET|POST /admin/faults, POST /admin/reset-cache, GET /admin/stats,
POST /admin/reset-stats (see docs/emulator.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from prefix_sidecar_tools.emulator import adapters
from prefix_sidecar_tools.emulator.config import EmulatorConfig
from prefix_sidecar_tools.emulator.engine import Engine, EngineStats, Outcome, Prepared
from prefix_sidecar_tools.emulator.kv_events import KvEventPublisher
from prefix_sidecar_tools.emulator.metrics import CONTENT_TYPE, LOAD_FORMAT_HEADER
from prefix_sidecar_tools.emulator.protocol import (
    SSE_DONE,
    ParsedRequest,
    RequestError,
    ResponseShaper,
    error_body,
    parse_request,
    render_chat,
    sse,
    usage,
)
from prefix_sidecar_tools.emulator.tokenizer import token_ids

ENGINE = web.AppKey("engine", Engine)
EMULATOR_VERSION = "0.8.5+emulated"


def _error(message: str, status: int) -> web.Response:
    return web.json_response(error_body(message, status), status=status)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc


def _prepare(engine: Engine, parsed: ParsedRequest) -> Prepared:
    """Resolve the model (the base one or an adapter, else vLLM's 404), tokenize and apply
    vLLM's length checks; the max_tokens default depends on the API."""
    config = engine.config
    adapter = engine.adapters.resolve(parsed.model)
    max_tokens = parsed.max_tokens
    prepared = Prepared.build(
        parsed.prompt,
        max_tokens or 1,
        parsed.stop,
        parsed.seed,
        parsed.temperature,
        config.block_size,
        adapter,
        parsed.cache_salt,
    )
    room = config.max_model_len - prepared.prompt_tokens
    if max_tokens is None:
        default = config.default_chat_max_tokens if parsed.chat else config.default_max_tokens
        max_tokens = max(1, min(default, room))
    if prepared.prompt_tokens + max_tokens > config.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {prepared.prompt_tokens + max_tokens} tokens "
            f"({prepared.prompt_tokens} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    if not engine.fits(prepared):
        raise RequestError(
            f"prompt of {prepared.prompt_tokens} tokens does not fit the KV "
            f"cache ({config.kv_tokens} tokens); raise --kv-tokens"
        )
    prepared.max_tokens = max_tokens
    return prepared


async def _inference(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE]
    faults = engine.config.faults
    try:
        parsed = parse_request(await _json_body(request), engine.config, chat)
        prepared = _prepare(engine, parsed)
    except RequestError as exc:
        return web.json_response(exc.body(), status=exc.status)
    if faults.fail_next > 0:
        faults.fail_next -= 1
        return _error(f"injected fault: HTTP {faults.fail_status}", faults.fail_status)
    if faults.stall_seconds > 0:
        await asyncio.sleep(faults.stall_seconds)
    served = prepared.adapter.name if prepared.adapter else engine.config.model
    shaper = ResponseShaper(served, chat)
    outcome = Outcome(prompt_tokens=prepared.prompt_tokens)
    load_format = request.headers.get(LOAD_FORMAT_HEADER, "")
    if parsed.stream:
        on_streams = engine.config.load_header_on_streams
        load = engine.metrics.load_header(load_format) if on_streams else {}
        return await _stream(request, engine, prepared, parsed, shaper, outcome, load)
    async with contextlib.aclosing(engine.generate(prepared, outcome)) as pieces:
        async for _ in pieces:
            pass
    body = shaper.full(outcome.text, outcome.finish_reason, outcome.stop_reason, _usage(outcome))
    # Like vLLM: the pod's state as the response is made, after the request ran.
    return web.json_response(body, headers=engine.metrics.load_header(load_format))


def _usage(outcome: Outcome) -> dict[str, Any]:
    return usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)


async def _stream(
    request: web.Request,
    engine: Engine,
    prepared: Prepared,
    parsed: ParsedRequest,
    shaper: ResponseShaper,
    outcome: Outcome,
    load: dict[str, str],
) -> web.StreamResponse:
    faults = engine.config.faults
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **load}
    )
    await response.prepare(request)
    sent = 0  # data events written, for the drop/malformed faults
    first = True
    try:
        async with contextlib.aclosing(engine.generate(prepared, outcome)) as ticks:
            async for pieces in ticks:
                events: list[dict[str, Any]] = []
                if first and parsed.chat:
                    events.append(shaper.role_chunk())
                first = False
                done = outcome.finish_reason is not None
                body = pieces[:-1] if done else pieces
                events += [shaper.chunk(text) for text in body if text]
                if done:
                    events.append(
                        shaper.chunk(
                            pieces[-1] if pieces else "", outcome.finish_reason, outcome.stop_reason
                        )
                    )
                    if parsed.include_usage:
                        events.append(shaper.usage_chunk(_usage(outcome)))
                payload = bytearray()
                for event in events:
                    if faults.drop_after_chunks is not None and sent >= faults.drop_after_chunks:
                        await response.write(bytes(payload))
                        _abort(request)
                        return response
                    encoded = sse(event)
                    if faults.malformed_after_chunks == sent:
                        encoded = encoded[: len(encoded) // 2] + b"\n\n"  # JSON cut in half
                    payload += encoded
                    sent += 1
                if done:
                    payload += SSE_DONE
                await response.write(bytes(payload))
    except ConnectionError:
        return response  # the client went away; aclosing() already freed the slot and KV
    await response.write_eof()
    return response


def _abort(request: web.Request) -> None:
    """Close the socket without ending the chunked body: the client sees a broken stream."""
    if request.transport is not None:
        request.transport.abort()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, chat=True)


async def health(request: web.Request) -> web.Response:
    return web.Response(status=503 if request.app[ENGINE].config.faults.unhealthy else 200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": EMULATOR_VERSION})


async def tokenize(request: web.Request) -> web.Response:
    config = request.app[ENGINE].config
    try:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        if "messages" in body:
            text = render_chat(body["messages"])
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise RequestError("give 'prompt' (a string) or 'messages' (a chat)")
    except RequestError as exc:
        return _error(exc.message, exc.status)
    if config.faults.tokenize_stall_seconds > 0:
        await asyncio.sleep(config.faults.tokenize_stall_seconds)
    tokens = token_ids(text.encode("utf-8"), config.vocab_size)
    return web.json_response(
        {
            "count": len(tokens),
            "max_model_len": config.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }
    )


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(dataclasses.asdict(request.app[ENGINE].config.faults))


async def post_faults(request: web.Request) -> web.Response:
    faults = request.app[ENGINE].config.faults
    try:
        changes = await _json_body(request)
        if not isinstance(changes, dict):
            raise RequestError("body must be a JSON object of fault settings")
        faults.update(changes)
    except (RequestError, ValueError) as exc:
        return _error(str(exc), 400)
    return web.json_response(dataclasses.asdict(faults))


async def reset_cache(request: web.Request) -> web.Response:
    dropped = request.app[ENGINE].reset_cache()
    return web.json_response({"dropped_blocks": dropped})


async def vllm_reset_prefix_cache(request: web.Request) -> web.Response:
    request.app[ENGINE].reset_cache()
    return web.Response(status=200)


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].stats_json())


async def reset_stats(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.stats = EngineStats(
        prefills=type(engine.stats.prefills)(maxlen=engine.config.stats_history)
    )
    return web.json_response({"ok": True})


async def kv_event_sources(request: web.Request) -> web.Response:
    publisher = request.app[ENGINE].kv_events
    assert publisher is not None  # the route exists only with --kv-events
    return web.json_response(publisher.sources())


def _publish_kv_events(app: web.Application, engine: Engine, host: str) -> None:
    """--kv-events: the publisher's sockets open with the app and close with it."""
    config = engine.config
    publisher = KvEventPublisher(config.kv_events, config.block_size, config.vocab_size, host)
    engine.kv_events = publisher

    async def opened(_: web.Application) -> None:
        publisher.open()

    async def closed(_: web.Application) -> None:
        await publisher.close()

    app.on_startup.append(opened)
    app.on_cleanup.append(closed)
    app.router.add_get("/kv_event_sources", kv_event_sources)


def make_app(config: EmulatorConfig | None = None, host: str = "127.0.0.1") -> web.Application:
    """The aiohttp application of one pod; call inside a running event loop. `host`: where
    its KV-event sockets bind (with --kv-events), the pod's own address."""
    config = config or EmulatorConfig()
    config.validate()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE] = Engine(config)
    if config.kv_events != "off":
        _publish_kv_events(app, app[ENGINE], host)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    adapters.add_routes(app, app[ENGINE].adapters)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", vllm_reset_prefix_cache)
    app.router.add_get("/admin/faults", get_faults)
    app.router.add_post("/admin/faults", post_faults)
    app.router.add_post("/admin/reset-cache", reset_cache)
    app.router.add_get("/admin/stats", stats)
    app.router.add_post("/admin/reset-stats", reset_stats)
    return app


@contextlib.asynccontextmanager
async def run_emulator(
    config: EmulatorConfig | None = None, port: int = 0, host: str = "127.0.0.1"
) -> AsyncIterator[str]:
    """Serve one pod in this process; yields its base URL (port 0 = an ephemeral port)."""
    if config is not None:  # a private copy: run-time fault changes stay in this pod
        config = dataclasses.replace(config, faults=dataclasses.replace(config.faults))
    app = make_app(config, host)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        yield f"http://{host}:{bound_port}"
    finally:
        await runner.cleanup()
