"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/models, /health.

A thin adapter beside the gRPC servicer: it reads what routing needs from the caller's
body (sidecar.server.openai_body), asks the same router, and relays the caller's own bytes
to the pods (sidecar.server.openai_relay); errors take OpenAI's body and statuses, so the
openai SDK raises its usual exceptions. It listens on `openai_listen`: loopback HOST:PORT
in plain HTTP, any other address only with TLS (the config refuses it without), or a unix
socket.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from sidecar import __version__
from sidecar.config import Config
from sidecar.hostport import is_loopback_host, split_host_port
from sidecar.membership.pool import SERVING, BackendPool
from sidecar.metrics import FRONT_HTTP, Metrics
from sidecar.prefixes import PrefixEntry, PrefixNotFound, PrefixStore
from sidecar.routing.router import Decision, NoBackendError, Router
from sidecar.server.openai_body import FrontError, bad_request, parse_request
from sidecar.server.openai_relay import RETRY_AFTER_S, ByteRelay
from sidecar.server.openai_splice import splice_prefix
from sidecar.server.probes import Readiness
from sidecar.server.relay import RelayOutcome
from sidecar.server.request_log import record_outcome
from sidecar.server.trace_context import (
    REQUEST_ID,
    TRACEPARENT,
    TraceContext,
    valid_request_id,
    valid_traceparent,
)
from sidecar.server.unix_socket import (
    SocketIdentity,
    apply_socket_permissions,
    prepare_socket_path,
    remove_own_socket,
    restrictive_umask,
    socket_identity,
)

logger = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 5.0
MAX_MODELS_BYTES = 256 * 1024
# The metrics' rpc label of each door (the gRPC RPCs are "Complete", "Chat", ...).
RPC_COMPLETIONS = "http_completions"
RPC_CHAT = "http_chat"
# Above this, parsing (json.loads, ~1.2 ms per MiB) and routing (encoding the prompt's
# head, ~0.4 ms per MiB) are separate steps of the loop: at the 8 MiB default limit each is
# under 10 ms, together they were ~12 ms.
YIELD_ABOVE_BYTES = 1024 * 1024
# Thin queries: the registered prefix to put before the caller's prompt or messages.
PREFIX_ID_HEADER = "x-prefix-id"
PREFIX_NAME_HEADER = "x-prefix-name"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class OpenAIFront:
    def __init__(
        self,
        config: Config,
        router: Router,
        store: PrefixStore,
        relay: ByteRelay,
        pool: BackendPool,
        metrics: Metrics,
        readiness: Readiness,
        api_key: str,
    ) -> None:
        self.config = config
        self.router = router
        self.store = store
        self.relay = relay
        self.pool = pool
        self.metrics = metrics
        self.readiness = readiness
        self._pod_headers = {
            "Content-Type": "application/json",
            "User-Agent": f"prefix-sidecar/{__version__}",
        }
        if api_key:
            self._pod_headers["Authorization"] = f"Bearer {api_key}"
        self._runner: web.AppRunner | None = None
        self._socket_identity: SocketIdentity | None = None
        self.port: int | None = None

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        listen = self.config.openai_listen
        app = web.Application(
            client_max_size=self.config.max_message_bytes, middlewares=[_openai_errors]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        # handler_cancellation: a caller that leaves cancels its handler, which closes the
        # pod's connection at once instead of at the next chunk. No access log: it would
        # carry nothing a caller needs and cost a line per request.
        # On stop, streams get grace_s to finish, like the gRPC door's.
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.config.grace_s,
        )
        await self._runner.setup()
        site: web.BaseSite
        if listen.startswith("unix://"):
            path = listen[len("unix://") :]
            prepare_socket_path(path)
            with restrictive_umask(self.config.socket_mode):
                site = web.UnixSite(self._runner, path)
                await site.start()
                self._socket_identity = socket_identity(path)
            apply_socket_permissions(path, self.config.socket_mode, self.config.socket_group)
        else:
            host, port = split_host_port(listen)
            site = web.TCPSite(self._runner, host, port, ssl_context=self._tls(host))
            await site.start()
            self.port = port
        logger.info("OpenAI HTTP front listening on %s", listen)

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        listen = self.config.openai_listen
        if listen.startswith("unix://"):
            remove_own_socket(listen[len("unix://") :], self._socket_identity)
            self._socket_identity = None

    def _tls(self, host: str) -> ssl.SSLContext | None:
        """Loopback serves plain HTTP; anything else TLS (the config demands the files)."""
        if is_loopback_host(host):
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.config.tls_cert_file, self.config.tls_key_file)
        if self.config.tls_client_ca_file:
            context.load_verify_locations(self.config.tls_client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    # --- handlers -----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, "/v1/completions", RPC_COMPLETIONS, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, "/v1/chat/completions", RPC_CHAT, chat=True)

    async def _infer(
        self, request: web.Request, path: str, rpc: str, *, chat: bool
    ) -> web.StreamResponse:
        started = time.perf_counter()
        entry = self._prefix_of(request)
        raw = await request.read()  # bounded by client_max_size: 413 above it
        parsed = parse_request(raw, chat=chat)
        if len(raw) > YIELD_ABOVE_BYTES:
            await asyncio.sleep(0)
        try:
            decision: Decision
            if entry is None:
                if chat:
                    decision = self.router.for_chat(list(parsed.messages))
                else:
                    decision = self.router.for_prompt(parsed.route_text)
            else:
                decision = self.router.for_prefix(entry)
                raw = splice_prefix(raw, entry.json_bytes, chat=chat)
        except NoBackendError as exc:
            raise FrontError(
                503,
                str(exc),
                type="service_unavailable",
                code="no_backend",
                retry_after_s=RETRY_AFTER_S,
            ) from None
        self.metrics.child(self.metrics.decision, FRONT_HTTP, rpc).observe(
            decision.decision_ns / 1e9
        )
        trace = _trace_context(request)
        outcome = RelayOutcome()
        try:
            return await self.relay.forward(
                request,
                decision,
                path,
                raw,
                self._headers_for_pod(request, trace),
                stream=parsed.stream,
                outcome=outcome,
            )
        except BaseException:
            if outcome.status == "OK":
                outcome.status = "CANCELLED"  # the caller left, or the handler failed
            raise
        finally:
            # The same request line, counters and cost as a gRPC call: front=http, rpc=http_*.
            prefix = decision.prefix.name if decision.prefix is not None else ""
            record_outcome(
                self.metrics,
                rpc,
                prefix,
                decision.branch,
                outcome,
                started,
                trace,
                front=FRONT_HTTP,
            )

    def _prefix_of(self, request: web.Request) -> PrefixEntry | None:
        """The prefix a thin query names in its headers; 404 when it is not registered."""
        prefix_id = request.headers.get(PREFIX_ID_HEADER)
        name = request.headers.get(PREFIX_NAME_HEADER)
        if prefix_id is None and name is None:
            return None
        if prefix_id is not None and name is not None:
            raise bad_request(f"send {PREFIX_ID_HEADER} or {PREFIX_NAME_HEADER}, not both")
        try:
            if prefix_id is not None:
                return self.store.get(prefix_id)
            assert name is not None
            return self.store.by_name(name)
        except PrefixNotFound as exc:
            raise FrontError(
                404,
                str(exc)[:300],
                param=PREFIX_ID_HEADER if prefix_id is not None else PREFIX_NAME_HEADER,
                code="prefix_not_found",
            ) from None

    def _headers_for_pod(self, request: web.Request, trace: TraceContext) -> dict[str, str]:
        """Ours, the caller's key (which wins over the configured one) and its well-formed
        trace headers. Neither key is ever logged or echoed."""
        headers = dict(self._pod_headers)
        key = request.headers.get("Authorization")
        if key:
            headers["Authorization"] = key
        headers.update(trace.http_headers())
        return headers

    async def models(self, request: web.Request) -> web.StreamResponse:
        """The model list of a serving pod, as it wrote it."""
        serving = [b.url for b in self.pool.backends.values() if b.state == SERVING]
        headers = self._headers_for_pod(request, _trace_context(request))
        headers.pop("Content-Type")
        for backend in serving[: self.config.max_attempts]:
            try:
                async with self.relay.session.get(
                    backend + "/v1/models",
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S),
                    allow_redirects=False,
                ) as response:
                    if response.status >= 300 and response.status != 401:
                        continue
                    body = await response.content.read(MAX_MODELS_BYTES)
                    if not response.content.is_eof():
                        continue  # longer than any model list: not a model list
                    answer = web.Response(status=response.status, body=body)
                    answer.content_type = response.content_type
                    answer.headers["x-prefix-sidecar-backend"] = backend
                    return answer
            except (TimeoutError, aiohttp.ClientError):
                continue
        raise FrontError(
            503,
            "no serving pod answered /v1/models",
            type="service_unavailable",
            code="no_backend",
            retry_after_s=RETRY_AFTER_S,
        )

    async def health(self, _: web.Request) -> web.Response:
        why = self.readiness.reason()
        if why is None:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "reason": why}, status=503)


def _trace_context(request: web.Request) -> TraceContext:
    """The caller's traceparent and x-request-id, dropped when malformed (as on gRPC)."""
    headers = request.headers
    return TraceContext(
        valid_traceparent(headers.get(TRACEPARENT)), valid_request_id(headers.get(REQUEST_ID))
    )


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in OpenAI's body, aiohttp's own (404, 405, 413) included."""
    try:
        return await handler(request)
    except FrontError as exc:
        return _error_response(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return _error_response(
            FrontError(
                413,
                f"the body is over the size limit (config max_message_bytes): {exc.text}",
                code="request_too_large",
            )
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(FrontError(exc.status, exc.reason, code=str(exc.status)))


def _error_response(exc: FrontError) -> web.Response:
    response = web.Response(status=exc.status, body=exc.body(), content_type="application/json")
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response
