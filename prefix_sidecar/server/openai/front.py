"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/models, /health.

A thin adapter beside the gRPC servicer: it reads what routing needs from the body
(body.py), asks the same router, and relays the caller's own bytes through the same attempt
loop (prefix_sidecar.upstream.byte_relay); errors take OpenAI's shape, so the openai SDK
raises its usual exceptions. `openai_listen`: loopback HOST:PORT in plain HTTP, any other
address only with TLS (the config enforces it), or a unix socket. The server is http1 (no
HTTP library: four fixed paths need none, and it saves ~0.19 ms per 240 KB request over
aiohttp's, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from dataclasses import InitVar, dataclass, field

from prefix_sidecar import __version__
from prefix_sidecar.config import Config
from prefix_sidecar.hostport import is_loopback_host, split_host_port
from prefix_sidecar.metrics import FRONT_HTTP, Metrics
from prefix_sidecar.prefixes import PrefixEntry, PrefixNotFound, PrefixStore
from prefix_sidecar.routing.cost import tokens_of
from prefix_sidecar.routing.decision import Decision, NoBackendError
from prefix_sidecar.routing.precise import request_text
from prefix_sidecar.routing.router import Router
from prefix_sidecar.routing.scope import Scope
from prefix_sidecar.server.common.connections import front_cap, install_accept_log
from prefix_sidecar.server.common.probes import Readiness
from prefix_sidecar.server.common.request_log import record_outcome
from prefix_sidecar.server.common.tls import server_context
from prefix_sidecar.server.common.trace_context import (
    REQUEST_ID,
    TRACEPARENT,
    TraceContext,
    valid_request_id,
    valid_traceparent,
)
from prefix_sidecar.server.common.unix_socket import SocketFile
from prefix_sidecar.server.openai.body import FrontError, FrontRequest, bad_request
from prefix_sidecar.server.openai.http1 import Handler, HTTP1Server, Response, StreamedResponse
from prefix_sidecar.server.openai.http1_request import Request
from prefix_sidecar.server.openai.models import models_body, pod_models
from prefix_sidecar.server.openai.request_pool import read_in_pool
from prefix_sidecar.server.openai.splice import rename_model, splice_prefix
from prefix_sidecar.server.pools import Pools
from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER, RETRY_AFTER_S, forward
from prefix_sidecar.upstream.outcome import RelayOutcome

logger = logging.getLogger(__name__)

# The metrics' rpc label of each door (the gRPC RPCs are "Complete", "Chat", ...).
RPC_COMPLETIONS = "http_completions"
RPC_CHAT = "http_chat"
# Above this, reading the routing fields and routing are separate steps of the loop (the
# reading is itself in steps above body_steps.SYNC_BYTES, whatever the body's shape).
YIELD_ABOVE_BYTES = 1024 * 1024
# Thin queries: the registered prefix to put before the caller's prompt or messages.
PREFIX_ID_HEADER = "x-prefix-id"
PREFIX_NAME_HEADER = "x-prefix-name"

Answer = Response | StreamedResponse


@dataclass(eq=False)
class OpenAIFront:
    """The front's routes and lifecycle; `api_key` goes only into the pods' headers."""

    config: Config
    pools: Pools
    metrics: Metrics
    readiness: Readiness
    api_key: InitVar[str]
    port: int | None = field(default=None, init=False)  # the TCP port, once listening
    _pod_headers: dict[str, str] = field(init=False)
    _routes: dict[tuple[str, str], Handler] = field(init=False)
    _server: HTTP1Server | None = field(default=None, init=False)
    _listener: asyncio.AbstractServer | None = field(default=None, init=False)
    _socket_file: SocketFile | None = field(default=None, init=False)
    _requests: set[asyncio.Task[object]] = field(default_factory=set, init=False)

    def __post_init__(self, api_key: str) -> None:
        self._pod_headers = {
            "Content-Type": "application/json",
            "User-Agent": f"prefix-sidecar/{__version__}",
        }
        if api_key:
            self._pod_headers["Authorization"] = f"Bearer {api_key}"
        self._routes = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat,
            ("GET", "/v1/models"): self.models,
            ("GET", "/health"): self.health,
        }

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        listen = self.config.openai_listen
        # No access log: sidecar.requests has the request line. Both fronts share the fds
        # (server.common.connections), so each gets a cap below them.
        self._server = HTTP1Server(
            self._handle,
            max_body_bytes=self.config.max_message_bytes,
            error_body=_error_body,
            max_connections=front_cap(fronts=2),
        )
        loop = asyncio.get_running_loop()
        install_accept_log(loop)
        if listen.startswith("unix://"):
            path = listen[len("unix://") :]
            socket_file = SocketFile(path, self.config.socket_mode, self.config.socket_group)
            socket_file.prepare()
            self._socket_file = socket_file
            with socket_file.creating():
                self._listener = await loop.create_unix_server(self._server, path)
                socket_file.bound()
            socket_file.secure()
        else:
            host, port = split_host_port(listen)
            self._listener = await loop.create_server(
                self._server, host, port, ssl=self._tls(host), reuse_address=True
            )
            self.port = port
        logger.info("OpenAI HTTP front listening on %s", listen)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop listening, refuse new requests on open connections, give the running ones
        `grace_s` (default: the config's grace_s) to finish, then cancel what is left."""
        grace = self.config.grace_s if grace_s is None else grace_s
        if self._server is not None:
            self._server.draining = True  # each answer from now on closes its connection
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
            running = [task for task in self._requests if not task.done()]
            if running:
                _, late = await asyncio.wait(running, timeout=max(grace, 0.0))
                for task in late:
                    task.cancel()
                if late:
                    await asyncio.wait(late, timeout=1.0)
            if self._server is not None:
                self._server.close_all()  # idle keep-alive connections, and any left
        if self._socket_file is not None:
            self._socket_file.remove()

    def _tls(self, host: str) -> ssl.SSLContext | None:
        """Loopback serves plain HTTP; anything else TLS (the config demands the files)."""
        if is_loopback_host(host):
            return None
        config = self.config
        return server_context(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)

    # --- dispatch -----------------------------------------------------------------------

    async def _handle(self, request: Request) -> Answer:
        """Every answer, errors included, in OpenAI's shape."""
        handler = self._routes.get((request.method, request.path))
        try:
            if handler is None:
                if any(path == request.path for _, path in self._routes):
                    raise FrontError(405, f"{request.method} is not allowed on {request.path}")
                raise FrontError(404, f"no such endpoint: {request.path[:100]}", code="404")
            assert self._server is not None  # it runs this handler
            if self._server.draining:
                raise FrontError(
                    503,
                    "the sidecar is shutting down",
                    type="service_unavailable",
                    code="shutting_down",
                    retry_after_s=RETRY_AFTER_S,
                )
            return await handler(request)
        except FrontError as exc:
            return _error_response(exc)

    # --- handlers -----------------------------------------------------------------------

    async def completions(self, request: Request) -> Answer:
        return await self._infer(request, "/v1/completions", RPC_COMPLETIONS, chat=False)

    async def chat(self, request: Request) -> Answer:
        return await self._infer(request, "/v1/chat/completions", RPC_CHAT, chat=True)

    async def _infer(self, request: Request, path: str, rpc: str, *, chat: bool) -> Answer:
        started = time.perf_counter()
        task = asyncio.current_task()
        assert task is not None
        self._requests.add(task)
        try:
            return await self._infer_counted(request, path, rpc, chat=chat, started=started)
        finally:
            self._requests.discard(task)

    async def _infer_counted(
        self, request: Request, path: str, rpc: str, *, chat: bool, started: float
    ) -> Answer:
        trace = _trace_context(request)
        # One pool: known before the body is read (a refused body is counted in it too).
        outcome = RelayOutcome(pool=self.pools.default.name if len(self.pools) == 1 else "")
        try:
            raw = request.body  # at most max_message_bytes (the server answers 413 above)
            pool, parsed = await read_in_pool(self.pools, raw, chat)
            router = pool.router
            outcome.pool = pool.name
            if parsed.model and pool.pod_model(parsed.model) != parsed.model:
                raw = rename_model(raw, pool.pod_model(parsed.model))
            scope = Scope(pool.adapter_of(parsed.model or ""), parsed.cache_salt)
            entry = self._prefix_of(request, pool.store, scope)
            if len(raw) > YIELD_ABOVE_BYTES:
                await asyncio.sleep(0)
            if entry is None:
                decision = self._route(router, parsed, chat, scope, len(raw))
                if router.precise is not None and decision.prefix is None:
                    what = request_text(chat, parsed.messages, parsed.route_text)
                    decision = await router.precise.refine(
                        decision, what, parsed.model or "", scope
                    )
            else:
                decision = router.for_prefix(entry, scope, tokens_of(len(raw)))
                raw = splice_prefix(raw, entry.json_bytes, chat=chat)
        except NoBackendError as exc:
            self._count_refused(rpc, "UNAVAILABLE", started, trace, outcome.pool)
            raise FrontError(
                503,
                str(exc),
                type="service_unavailable",
                code="no_backend",
                retry_after_s=RETRY_AFTER_S,
            ) from None
        except FrontError as exc:
            # A request refused before routing is counted as the gRPC front counts one.
            status = _STATUS_NAMES.get(exc.status, "UNKNOWN")
            self._count_refused(rpc, status, started, trace, outcome.pool)
            raise
        try:
            return await forward(
                pool.relay,
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
            # Recorded as a gRPC call is (front=http, rpc=http_*); after the answer, off its path.
            decision_ns = decision.decision_ns
            self.metrics.child(self.metrics.decision, FRONT_HTTP, rpc).observe(decision_ns / 1e9)
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
                decision_ns=decision_ns,
            )

    def _count_refused(
        self, rpc: str, status: str, started: float, trace: TraceContext, pool: str
    ) -> None:
        outcome = RelayOutcome(pool=pool, status=status)
        record_outcome(self.metrics, rpc, "", "", outcome, started, trace, front=FRONT_HTTP)

    @staticmethod
    def _route(
        router: Router, parsed: FrontRequest, chat: bool, scope: Scope, size: int
    ) -> Decision:
        """The router's decision. A prompt matched in the body routes on its prefix; otherwise
        its head routes as the whole prompt would (the route key reads only the route window;
        no prefix matches the head of a prompt none matches). `size`: the body's bytes, the
        request's load weight (cost.py)."""
        prefix = parsed.prefix
        if parsed.matched and prefix is not None:
            return router.for_prefix(prefix, scope, tokens_of(size - prefix.size))
        if chat:
            return router.for_chat(list(parsed.messages), parsed.answers, scope, tokens_of(size))
        return router.for_prompt(parsed.route_text, parsed.marks, scope, tokens_of(size))

    @staticmethod
    def _prefix_of(request: Request, store: PrefixStore, scope: Scope) -> PrefixEntry | None:
        """The prefix a thin query names in its headers; 404 when it is not registered."""
        prefix_id = request.headers.get(PREFIX_ID_HEADER)
        name = request.headers.get(PREFIX_NAME_HEADER)
        if prefix_id is None and name is None:
            return None
        if prefix_id is not None and name is not None:
            raise bad_request(f"send {PREFIX_ID_HEADER} or {PREFIX_NAME_HEADER}, not both")
        try:
            if prefix_id is not None:
                return store.get(prefix_id)
            assert name is not None
            return store.by_name(name, scope)
        except PrefixNotFound as exc:
            raise FrontError(
                404,
                str(exc)[:300],
                param=PREFIX_ID_HEADER if prefix_id is not None else PREFIX_NAME_HEADER,
                code="prefix_not_found",
            ) from None

    def _headers_for_pod(self, request: Request, trace: TraceContext) -> dict[str, str]:
        """Ours, the caller's key (which wins over the configured one) and its well-formed
        trace headers. Neither key is ever logged or echoed."""
        headers = dict(self._pod_headers)
        key = request.headers.get("authorization")
        if key:
            headers["Authorization"] = key
        headers.update(trace.http_headers())
        return headers

    async def models(self, request: Request) -> Answer:
        """Every pool's models (models.py); one pool taking any model: its pod's list as
        the pod wrote it."""
        headers = self._headers_for_pod(request, _trace_context(request))
        headers.pop("Content-Type")
        answers = [(pool, await pod_models(pool, headers)) for pool in self.pools]
        if not self.config.pools:
            found = answers[0][1]
            if found is None:
                raise FrontError(
                    503,
                    "no serving pod answered /v1/models",
                    type="service_unavailable",
                    code="no_backend",
                    retry_after_s=RETRY_AFTER_S,
                )
            backend, answer = found
            labels = [(BACKEND_HEADER, backend)]
            if "content-type" in answer.headers:
                labels.append(("Content-Type", answer.headers["content-type"]))
            assert answer.body is not None
            return Response(answer.status, answer.body, labels)
        body = models_body([(pool, found[1] if found else None) for pool, found in answers])
        return Response(200, body, content_type="application/json")

    async def health(self, _: Request) -> Answer:
        why = self.readiness.reason()
        if why is None:
            return Response(200, b'{"status": "ok"}', content_type="application/json")
        body = json.dumps({"status": "unavailable", "reason": why}).encode()
        return Response(503, body, content_type="application/json")


# The request metrics' status of a request the front refuses before routing (gRPC's names).
_STATUS_NAMES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 405: "UNIMPLEMENTED"}
# The `code` of the errors the HTTP server answers itself (the others: None).
_SERVER_ERROR_CODES = {413: "request_too_large", 408: "request_timeout"}


def _error_body(status: int, message: str) -> bytes:
    """OpenAI's error body for an error the HTTP server answers itself (malformed framing,
    413 over max_message_bytes, a slow caller's 408)."""
    return FrontError(status, message, code=_SERVER_ERROR_CODES.get(status)).body()


def _trace_context(request: Request) -> TraceContext:
    """The caller's traceparent and x-request-id, dropped when malformed (as on gRPC)."""
    headers = request.headers
    return TraceContext(
        valid_traceparent(headers.get(TRACEPARENT)), valid_request_id(headers.get(REQUEST_ID))
    )


def _error_response(exc: FrontError) -> Response:
    headers = [("Content-Type", "application/json")]
    if exc.retry_after_s is not None:
        headers.append(("Retry-After", str(exc.retry_after_s)))
    return Response(exc.status, exc.body(), headers)
