"""Relay a caller's HTTP body to a pod and the pod's answer back, byte for byte.

The same failover rule as the gRPC relay: before the first byte of the answer reaches the
caller, a refused connection, a timeout, a 3xx, a 5xx or a 429 moves the request to the next
pod in preference order; any other 4xx is the caller's request and goes back as the pod
wrote it. After the first byte, a broken pod stream ends with an SSE error event (vLLM's
shape) and no [DONE], so no client takes a cut answer for a whole one. The answer is read
in bounded pieces; a caller that leaves cancels the handler, which closes the pod's
connection (vLLM aborts the request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping

import aiohttp
from aiohttp import web

from sidecar.membership.health import HealthMonitor
from sidecar.membership.pool import BackendPool
from sidecar.metrics import FRONT_HTTP, Metrics
from sidecar.routing.router import Decision
from sidecar.server.openai_body import FrontError
from sidecar.server.openai_usage import UsageTail
from sidecar.server.relay import RelayOutcome, RelayPolicy

logger = logging.getLogger("sidecar.requests")

READ_CHUNK = 64 * 1024
# A 4xx body the caller gets back: vLLM's errors are a few hundred bytes.
MAX_ERROR_BODY = 64 * 1024
# Seconds a caller is told to wait when no pod could take its request.
RETRY_AFTER_S = 1
BACKEND_HEADER = "x-prefix-sidecar-backend"
BRANCH_HEADER = "x-prefix-sidecar-branch"
# Pod response headers that describe the body we forward (the rest is the pod's business
# or hop-by-hop; the body is re-framed as chunked).
PASSED_HEADERS = ("Content-Type", "Cache-Control")


class _Retry(Exception):
    """This pod failed before the first byte: try the next."""

    def __init__(self, reason: str, detail: str, connection_failure: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.connection_failure = connection_failure


class ByteRelay:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: BackendPool,
        health: HealthMonitor | None,
        metrics: Metrics,
        policy: RelayPolicy,
        connect_timeout_s: float,
    ) -> None:
        self.session = session
        self.pool = pool
        self.health = health
        self.metrics = metrics
        self.policy = policy
        self.connect_timeout_s = connect_timeout_s

    async def forward(
        self,
        request: web.Request,
        decision: Decision,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        stream: bool,
        outcome: RelayOutcome,
    ) -> web.StreamResponse:
        """The pod's answer, already sent to the caller; FrontError 503 when no pod takes it.
        `outcome` gets the pod, the attempts, the status, the TTFT and the usage."""
        started = time.perf_counter()
        attempts = decision.preference[: self.policy.max_attempts]
        errors = outcome.errors
        for number, backend in enumerate(attempts, 1):
            outcome.backend, outcome.attempts = backend, number
            self.pool.acquire(backend)
            in_flight = self.metrics.child(self.metrics.in_flight, backend)
            in_flight.inc()
            response: aiohttp.ClientResponse | None = None
            try:
                response, first = await self._first_bytes(backend, path, body, headers, stream)
                if response.status != 200:
                    outcome.status = f"http_{response.status}"
                    return await self._pod_error(request, response, first, decision, backend)
                outcome.ttft_s = time.perf_counter() - started
                ttft = self.metrics.child(self.metrics.ttft, FRONT_HTTP, backend)
                ttft.observe(outcome.ttft_s)
                answer = await self._relay(request, response, first, decision, backend, outcome)
                if self.health is not None and outcome.status == "OK":
                    self.health.record_success(backend)
                return answer
            except _Retry as retry:
                errors.append(f"{backend}: {retry}")
                if retry.connection_failure and self.health is not None:
                    self.health.record_failure(backend, str(retry))
                self.metrics.failovers.labels(backend, retry.reason).inc()
                logger.info(
                    "attempt %d on %s failed before the first byte (%s)",
                    number,
                    backend,
                    retry.reason,
                )
            finally:
                if response is not None:
                    response.close()  # a no-op once released; else the pod's request ends
                self.pool.release(backend)
                in_flight.dec()
        outcome.status = "UNAVAILABLE"
        raise FrontError(
            503,
            f"no pod could serve the request after {len(errors)} attempt(s): "
            + "; ".join(errors)[:1500],
            type="service_unavailable",
            code="no_backend",
            retry_after_s=RETRY_AFTER_S,
        )

    async def _first_bytes(
        self, backend: str, path: str, body: bytes, headers: Mapping[str, str], stream: bool
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """Send, then wait for the answer's first bytes. A streamed answer has the first-token
        budget; a whole answer (headers come when it is done) has the request's."""
        total = self.policy.upstream_timeout_s
        budget = self.policy.first_token_timeout_s if stream else total
        timeout = aiohttp.ClientTimeout(total=total, sock_connect=self.connect_timeout_s)
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(budget):
                response = await self.session.post(
                    backend + path,
                    data=body,
                    headers=headers,
                    timeout=timeout,
                    allow_redirects=False,
                )
                if 300 <= response.status < 400 or response.status == 429:
                    raise _Retry(f"http_{response.status}", f"HTTP {response.status}")
                if response.status >= 500:
                    raise _Retry(f"http_{response.status}", f"HTTP {response.status}")
                if response.status != 200:
                    return response, await _read_bounded(response, MAX_ERROR_BODY)
                first = await response.content.read(READ_CHUNK)
                if not first:
                    raise _Retry("truncated", "the pod answered 200 with an empty body")
                return response, first
        except _Retry:
            if response is not None:
                response.close()
            raise
        except TimeoutError:
            if response is not None:
                response.close()
            raise _Retry("timeout", f"no first byte within {budget:.3g} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise _Retry("connection", f"cannot connect: {exc.os_error or exc}", True) from None
        except aiohttp.ClientError as exc:
            if response is not None:
                response.close()
            raise _Retry(
                "connection",
                f"request failed: {exc.__class__.__name__}",
                isinstance(exc, aiohttp.ServerDisconnectedError),
            ) from None

    async def _pod_error(
        self,
        request: web.Request,
        response: aiohttp.ClientResponse,
        first: bytes,
        decision: Decision,
        backend: str,
    ) -> web.StreamResponse:
        """A 4xx: the caller's request is at fault; it gets the pod's words as written."""
        answer = web.Response(status=response.status, body=first)
        self._headers(answer, response, decision, backend)
        await answer.prepare(request)
        await answer.write_eof()
        return answer

    async def _relay(
        self,
        request: web.Request,
        response: aiohttp.ClientResponse,
        first: bytes,
        decision: Decision,
        backend: str,
        outcome: RelayOutcome,
    ) -> web.StreamResponse:
        answer = web.StreamResponse(status=200)
        self._headers(answer, response, decision, backend)
        events = response.headers.get("Content-Type", "").startswith("text/event-stream")
        await answer.prepare(request)
        await answer.write(first)
        usage = UsageTail()
        usage.feed(first)
        while True:
            try:
                data = await response.content.read(READ_CHUNK)
            except (TimeoutError, aiohttp.ClientError) as exc:
                outcome.status = "PARTIAL"
                logger.info("the answer from %s broke after its first byte (%s)", backend, exc)
                if not events:
                    # A whole answer cannot carry an error: the caller's connection closes
                    # before the body's end, so its client sees a cut body, not a short one.
                    if request.transport is not None:
                        request.transport.close()
                    return answer
                await answer.write(_error_event(backend, exc))
                break
            if not data:
                break
            await answer.write(data)  # a caller that left raises (or is cancelled) here
            usage.feed(data)
        outcome.usage = usage.counts()
        await answer.write_eof()
        response.release()
        return answer

    @staticmethod
    def _headers(
        answer: web.StreamResponse,
        response: aiohttp.ClientResponse,
        decision: Decision,
        backend: str,
    ) -> None:
        for name in PASSED_HEADERS:
            value = response.headers.get(name)
            if value is not None:
                answer.headers[name] = value
        answer.headers[BACKEND_HEADER] = backend
        answer.headers[BRANCH_HEADER] = str(decision.branch)


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most `limit` bytes of a (short) error body; the rest is not read."""
    parts: list[bytes] = []
    size = 0
    while size < limit and (data := await response.content.read(limit - size)):
        parts.append(data)
        size += len(data)
    return b"".join(parts)


def _error_event(backend: str, exc: BaseException) -> bytes:
    """vLLM's mid-stream error event; the openai SDK raises APIError on it."""
    message = (
        f"the stream from {backend} broke after the first byte ({exc.__class__.__name__}); "
        "the text already sent is partial"
    )
    error = {"message": message, "type": "service_unavailable", "param": None, "code": 503}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
