"""The upstream client: `post`, the one way both fronts reach a pod; the gRPC front's SSE
streams over it (`open`); short control exchanges (`fetch`: health, /metrics, /tokenize,
/v1/models).

One HTTP/1.1 client (prefix_sidecar.upstream.lean_http) for `http://` and `https://` pods, one
connection budget per pod (`per_backend_connections`) whichever front sends. Closing an
unfinished stream closes its connection, so vLLM frees the slot at once; a stream that ended
with [DONE] keeps it (the body's last bytes are read in the background).
No redirect is followed: a 3xx would re-send the prompt to a host nobody configured under the
member's name, so it is a retryable failure of that pod. Whatever a pod says that reaches an
error (body, reason phrase, Location, error event) is redacted, then clipped.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from multidict import CIMultiDict

from prefix_sidecar import __version__
from prefix_sidecar.lifecycle import AsyncService
from prefix_sidecar.upstream import caller
from prefix_sidecar.upstream.answer import read_capped, read_whole
from prefix_sidecar.upstream.body import SplicedBody
from prefix_sidecar.upstream.errors import UpstreamError, error_words, retryable_status
from prefix_sidecar.upstream.lean_http import LeanHTTP, PodAnswer
from prefix_sidecar.upstream.pod_connection import PodHTTPError
from prefix_sidecar.upstream.sse import clip
from prefix_sidecar.upstream.stream import UpstreamStream

# A pod's error body: vLLM's are a few hundred bytes; the rest is not read.
ERROR_BODY_BYTES = 64 * 1024
ERROR_BODY_TIMEOUT_S = 2.0
# After [DONE] the end of the HTTP body (the chunked terminator) is normally already read or
# microseconds behind; a pod that takes longer, or sends more than this, loses the connection.
DRAIN_TIMEOUT_S = 1.0
DRAIN_MAX_BYTES = 64 * 1024


LOAD_FORMAT_HEADER = "endpoint-load-metrics-format"  # asks the pod for its load ...
LOAD_HEADER = "endpoint-load-metrics"  # ... which vLLM answers with (ORCA, docs/load-signals.md)


class LoadObserver(Protocol):
    """Where the pods' load reports go (prefix_sidecar.membership.load_signals.LoadSignals)."""

    def note_sent(self, url: str) -> None: ...

    def observe_header(self, url: str, value: str | None) -> None: ...


@dataclass(frozen=True)
class Fetched:
    """A control exchange's answer: `body` is None when it was over the caller's limit."""

    status: int
    headers: Mapping[str, str]  # names lowercased
    body: bytes | None


class UpstreamClient(AsyncService):
    """The one way to a pod: `post`, one answer type (PodAnswer), one connection budget.

    `per_backend_connections` bounds the requests open to each pod at once, whichever front
    sends them: a request over it waits for an answer to close. `https://` pods are verified
    against `tls_context` (default: the system's trust store)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        per_backend_connections: int = 512,
        api_key: str = "",
        load_observer: LoadObserver | None = None,
        on_unasked: Callable[[str], None] | None = None,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        """With a `load_observer`, every request asks the pod for its load report (vLLM's
        `endpoint-load-metrics-format: TEXT`) and every answer's report is handed to it.
        `on_unasked(pod)` counts a connection closed for bytes past an answer."""
        self.load_observer = load_observer
        self._per_backend = per_backend_connections
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "User-Agent": f"prefix-sidecar/{__version__}",
        }
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        if load_observer is not None:
            self._headers[LOAD_FORMAT_HEADER] = "TEXT"
        self._api_key = api_key
        self._draining: set[asyncio.Task[None]] = set()
        self._slots: dict[str, asyncio.Semaphore] = {}  # requests open at once, per pod
        self.lean = LeanHTTP(
            connect_timeout_s=connect_timeout_s,
            per_backend=per_backend_connections,
            on_unasked=on_unasked,
            tls_context=tls_context,
        )

    async def start(self) -> None:
        """Nothing to open: a pod's connections are made when it is first sent to."""

    async def close(self) -> None:
        for task in list(self._draining):
            task.cancel()
        if self._draining:
            await asyncio.gather(*self._draining, return_exceptions=True)
        self.lean.close()

    stop = close  # `async with UpstreamClient() as client:` closes it (AsyncService)

    async def open(
        self,
        backend: str,
        path: str,
        body: bytes | SplicedBody,
        *,
        timeout_s: float | None,
        chat: bool,
        headers: Mapping[str, str] | None = None,
        raw_events: bool = False,
    ) -> UpstreamStream:
        """POST and wait for the response headers; raise UpstreamError on any failure.
        `headers` are added to the request; they cannot replace the client's own
        (Content-Type, Accept, User-Agent, Authorization). `raw_events` keeps each event's
        JSON text in the deltas."""
        answer = await self.post(
            backend,
            path,
            body,
            self._with_own(headers) if headers else self._headers,
            timeout_s=timeout_s,
        )
        if answer.status != 200:
            raw = await read_capped(answer, ERROR_BODY_BYTES, ERROR_BODY_TIMEOUT_S)
            answer.close()
            raise self.refused(backend, answer.status, raw)
        return UpstreamStream(
            backend, answer, chat, self.redact, self._recycle, raw_events=raw_events
        )

    async def post(
        self,
        backend: str,
        path: str,
        body: bytes | SplicedBody,
        headers: Mapping[str, str],
        *,
        timeout_s: float | None,
    ) -> PodAnswer:
        """POST `body` with exactly `headers` and return the answer once its final status
        and headers are in, whatever its status but a redirect; UpstreamError (retryable)
        when the pod cannot be reached, answers 3xx or breaks HTTP. Both fronts send
        through here."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        release = await self._slot(backend, deadline)
        observer = self.load_observer
        if observer is not None:
            observer.note_sent(backend)
            headers = self._asking_load(headers)
        try:
            answer = await self._send("POST", backend, path, body, headers, deadline, release)
        except BaseException:
            release()
            raise
        self._refuse_redirect(backend, answer)
        if observer is not None:
            observer.observe_header(backend, answer.headers.get(LOAD_HEADER))
        return answer

    async def fetch(
        self,
        method: str,
        backend: str,
        path: str,
        *,
        timeout_s: float,
        limit: int,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> Fetched:
        """A short control exchange read whole within `timeout_s` and `limit` body bytes (past
        them the rest is never read and `body` is None). Sends exactly `headers`, skips the
        request budget (a pod busy with streams must not look dead to its health check);
        UpstreamError as `post` raises it, or when `timeout_s` passes."""
        try:
            async with asyncio.timeout(timeout_s):
                answer = await self._send(
                    method, backend, path, body, headers or {}, None, lambda: None
                )
                self._refuse_redirect(backend, answer)
                try:
                    whole = await read_whole(answer, backend, limit, self.redact)
                finally:
                    answer.close()  # the connection is kept only when the body was read whole
        except TimeoutError:
            raise UpstreamError(
                backend, f"timed out after {timeout_s:g}s", retryable=True
            ) from None
        return Fetched(answer.status, answer.headers, whole)

    async def _send(
        self,
        method: str,
        backend: str,
        path: str,
        body: bytes | SplicedBody,
        headers: Mapping[str, str],
        deadline: float | None,
        on_close: Callable[[], None],
    ) -> PodAnswer:
        """One exchange up to its final status and headers; the pod's failures as
        UpstreamError."""
        parts = body.parts if isinstance(body, SplicedBody) else (body,)
        try:
            return await self.lean.send(
                method, backend, path, parts, headers, deadline=deadline, on_close=on_close
            )
        except PodHTTPError as exc:
            raise UpstreamError(
                backend,
                clip(self.redact(str(exc))),
                retryable=True,
                connection_failure=exc.connection_failure,
            ) from None

    def _refuse_redirect(self, backend: str, answer: PodAnswer) -> None:
        """UpstreamError (retryable) for a redirect; the answer is closed, as its body is not
        worth reading (lean_http answers only a final status, 200-599)."""
        status = answer.status
        if 300 <= status < 400:
            answer.close()
            location = clip(self.redact(answer.headers.get("location", "")), 200)
            raise UpstreamError(
                backend,
                f"HTTP {status} redirect to {location or '(no Location)'}: "
                "the sidecar does not follow redirects from a pod",
                retryable=True,
                status=status,
            )

    async def _slot(self, backend: str, deadline: float | None) -> Callable[[], None]:
        """Wait for one of the pod's `per_backend_connections`; its release. A request that
        had to wait asks whether its caller is still there (prefix_sidecar.upstream.caller)."""
        slots = self._slots.get(backend)
        if slots is None:
            if len(self._slots) > 4096:  # pods come and go: keep the table bounded
                self._slots = {url: s for url, s in self._slots.items() if s.locked()}
            slots = self._slots[backend] = asyncio.Semaphore(self._per_backend)
        if not slots.locked():
            await slots.acquire()  # free: no wait
            return slots.release
        async with asyncio.timeout_at(deadline):
            await slots.acquire()
        try:
            await caller.check_after_wait()
        except BaseException:
            slots.release()
            raise
        return slots.release

    def refused(self, backend: str, status: int, raw: bytes) -> UpstreamError:
        """The error of a pod that answered `status` (neither 200 nor 3xx) with the body `raw`,
        in its own (redacted, clipped) words. Retryable unless a 4xx other than 429."""
        message = clip(self.redact(error_words(raw, f"HTTP {status}")))
        return UpstreamError(
            backend,
            f"HTTP {status}: {message}",
            retryable=retryable_status(status),
            status=status,
        )

    def _asking_load(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """`headers` asking the pod for its load report (the fronts' own header sets may
        lack it; the client's own already have it)."""
        if LOAD_FORMAT_HEADER in headers:
            return headers
        return {**headers, LOAD_FORMAT_HEADER: "TEXT"}

    def _with_own(self, headers: Mapping[str, str]) -> CIMultiDict[str]:
        """`headers` plus the client's own, which replace any of the same name (any case)."""
        merged = CIMultiDict(headers)
        merged.update(self._headers)
        return merged

    def _recycle(self, answer: PodAnswer) -> None:
        """Keep a finished stream's connection once its body has ended (read in the
        background: after [DONE] the chunked terminator may still be on its way)."""
        if answer.done:
            answer.close()
            return
        task = asyncio.get_running_loop().create_task(_drain(answer))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    def redact(self, text: str) -> str:
        """A careless pod may echo the Authorization header in its error: the key must not
        reach callers or logs through the pod's words."""
        return text.replace(self._api_key, "[redacted]") if self._api_key else text


async def _drain(answer: PodAnswer) -> None:
    """Read what follows [DONE] up to the end of the body, then close the answer (its
    connection is reused if the body ended soon and small)."""
    try:
        await read_capped(answer, DRAIN_MAX_BYTES, DRAIN_TIMEOUT_S)
    finally:
        answer.close()
