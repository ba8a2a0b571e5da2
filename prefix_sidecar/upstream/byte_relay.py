"""The HTTP front's side of the relay: the caller's body to a pod, the pod's bytes back.

The attempt loop is the gRPC path's (relay.Relay.attempts, front="http"); this module is what
differs. The body goes as the caller wrote it; a 200 comes back byte for byte. A 4xx other than
429 is the caller's and goes back as the pod wrote it, without failover; any other non-200
fails over (a 204 or 304 carries no completion). After the first byte a broken stream ends with
vLLM's SSE error event and no [DONE], so no client takes a cut answer for a whole one; a whole
JSON answer cannot carry an error, so its connection is closed before the body's end. A caller
that leaves cancels the handler, which closes the pod's connection (vLLM aborts the request).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Mapping

from prefix_sidecar.metrics import FRONT_HTTP
from prefix_sidecar.routing.cost import Prefill
from prefix_sidecar.routing.decision import Decision
from prefix_sidecar.server.openai.body import FrontError
from prefix_sidecar.server.openai.http1 import Request, Response, StreamedResponse
from prefix_sidecar.upstream.answer import read_capped, read_from
from prefix_sidecar.upstream.byte_usage import UsageTail
from prefix_sidecar.upstream.client import ERROR_BODY_BYTES, ERROR_BODY_TIMEOUT_S, UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError
from prefix_sidecar.upstream.lean_http import PodAnswer
from prefix_sidecar.upstream.outcome import RelayOutcome
from prefix_sidecar.upstream.relay import Relay

logger = logging.getLogger("sidecar.requests")

# Seconds a caller is told to wait when no pod could take its request.
RETRY_AFTER_S = 1
BACKEND_HEADER = "x-prefix-sidecar-backend"
BRANCH_HEADER = "x-prefix-sidecar-branch"
# Pod response headers that describe the body we forward (the rest is the pod's business
# or hop-by-hop; the body is re-framed as chunked).
PASSED_HEADERS = ("Content-Type", "Cache-Control")


class PodRefusal(Exception):
    """The pod refused the caller's request: its status and words go back as written."""

    def __init__(
        self, backend: str, status: int, body: bytes, headers: tuple[tuple[str, str], ...]
    ) -> None:
        super().__init__(f"HTTP {status}")
        self.backend = backend
        self.status = status
        self.body = body
        self.headers = headers


class BrokenAnswer(Exception):
    """The pod's answer broke after its first byte reached the caller."""

    def __init__(self, backend: str, exc: UpstreamError) -> None:
        super().__init__(exc.message)
        self.backend = backend


class ByteExchange:
    """One request's attempts (Relay.attempts' Exchange): the body as the caller wrote it,
    the answer as the pod writes it."""

    def __init__(
        self, client: UpstreamClient, path: str, body: bytes, headers: Mapping[str, str]
    ) -> None:
        self.client = client
        self.path = path
        self.body = body
        self.headers = headers
        self.answer: PodAnswer | None = None
        self.usage = UsageTail()
        self._backend = ""
        self._refusal: PodRefusal | None = None

    async def first(self, backend: str, attempt: int, timeout_s: float) -> list[bytes]:
        self._backend = backend
        self.answer = answer = await self.client.post(
            backend, self.path, self.body, self.headers, timeout_s=timeout_s
        )
        status = answer.status
        if status != 200:
            body = await read_capped(answer, ERROR_BODY_BYTES, ERROR_BODY_TIMEOUT_S)
            error = self.client.refused(backend, status, body)
            if not error.retryable:
                self._refusal = PodRefusal(backend, status, body, _passed(answer.headers))
            raise error
        data = await self._read()
        if not data:
            raise UpstreamError(backend, "the pod answered 200 with an empty body", retryable=True)
        return [data]

    async def next(self) -> list[bytes] | None:
        data = await self._read()
        return [data] if data else None

    async def _read(self) -> bytes:
        assert self.answer is not None
        data = await read_from(self.answer, self._backend, self.client.redact)
        self.usage.feed(data)
        return data

    def close(self) -> None:
        answer, self.answer = self.answer, None
        if answer is not None:
            answer.close()  # an answer read whole keeps its connection; else the pod stops

    def broken(self, backend: str, exc: UpstreamError, expired: bool) -> BaseException:
        return BrokenAnswer(backend, exc)

    def rejected(self, backend: str, exc: UpstreamError, outcome: RelayOutcome) -> BaseException:
        outcome.status = f"http_{exc.status}"
        assert self._refusal is not None
        return self._refusal

    def exhausted(self, errors: list[str], expired: bool) -> BaseException:
        return FrontError(
            503,
            f"no pod could serve the request after {len(errors)} attempt(s): "
            + "; ".join(errors)[:1500],
            type="service_unavailable",
            code="no_backend",
            retry_after_s=RETRY_AFTER_S,
        )

    def finished(self) -> bool:
        """The pod's answer is read to its end: the last read is the whole rest, sent with the
        answer's end in one write (with a Content-Length if it came in one piece)."""
        return self.answer is not None and self.answer.done

    def passed_headers(self) -> tuple[tuple[str, str], ...]:
        assert self.answer is not None
        return _passed(self.answer.headers)


async def forward(
    relay: Relay,
    request: Request,
    decision: Decision,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    stream: bool,
    outcome: RelayOutcome,
) -> Response | StreamedResponse:
    """The pod's answer, already sent to the caller; FrontError 503 when no pod takes it.
    `outcome` gets the pod, the attempts, the status, the TTFT and the usage. A streamed
    answer's first byte has the first-token budget; a whole answer's (headers come when it
    is done) has the request's."""
    exchange = ByteExchange(relay.client, path, body, headers)
    parts = relay.attempts(
        decision.preference,
        exchange,
        front=FRONT_HTTP,
        outcome=outcome,
        first_timeout_s=None if stream else relay.policy.upstream_timeout_s,
        forced_first=decision.forced,
        prefill=Prefill.of(decision),
    )
    try:
        return await _send(request, decision, exchange, parts, outcome)
    except ConnectionError:
        # The caller left between the handler's cancellation and our write (its transport
        # closing, the cancel not yet delivered): nobody to answer, and no server error.
        outcome.status = "CANCELLED"
        logger.info("the caller left before its answer was written")
        return Response(499)  # the server finds the connection gone and writes nothing


async def _send(
    request: Request,
    decision: Decision,
    exchange: ByteExchange,
    parts: AsyncGenerator[bytes, None],
    outcome: RelayOutcome,
) -> Response | StreamedResponse:
    """The pod's answer, written to the caller as its parts come; a refusal or a break
    after the first byte answered as the caller's client understands it."""
    answer: StreamedResponse | None = None
    last = b""  # the end of an answer read whole: sent with its end, in one write
    try:
        async with contextlib.aclosing(parts):
            async for data in parts:
                if answer is None:
                    labels = _label(exchange.passed_headers(), outcome.backend, decision)
                    answer = StreamedResponse(request, 200, labels)
                if exchange.finished():
                    last += data
                    continue
                await answer.write(data)  # a caller that left raises (or is cancelled) here
    except PodRefusal as refusal:
        labels = _label(refusal.headers, refusal.backend, decision)
        return Response(refusal.status, refusal.body, labels)
    except BrokenAnswer as exc:
        assert answer is not None
        logger.info("the answer from %s broke after its first byte (%s)", exc.backend, exc)
        if not (answer.header("Content-Type") or "").startswith("text/event-stream"):
            # A whole answer cannot carry an error: the caller's connection closes before
            # the body's end, so its client sees a cut body, not a short one.
            answer.abort()
            return answer
        last = _error_event(exc.backend, exc)
    outcome.usage = exchange.usage.counts()
    assert answer is not None
    await answer.end(last)
    return answer


def _label(
    passed: tuple[tuple[str, str], ...], backend: str, decision: Decision
) -> list[tuple[str, str]]:
    return [*passed, (BACKEND_HEADER, backend), (BRANCH_HEADER, str(decision.branch))]


def _passed(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    found = ((name, headers.get(name.lower())) for name in PASSED_HEADERS)
    return tuple((name, value) for name, value in found if value is not None)


def _error_event(backend: str, exc: BaseException) -> bytes:
    """vLLM's mid-stream error event; the openai SDK raises APIError on it."""
    message = (
        f"the stream from {backend} broke after the first byte ({exc}); "
        "the text already sent is partial"
    )
    error = {"message": message, "type": "service_unavailable", "param": None, "code": 503}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
