"""The upstream client: one pooled aiohttp session, streaming OpenAI-style SSE from pods.

Errors are classified where they happen, because the caller's only question is "may I try
the next pod?": a refused connection, a timeout, a 5xx or a 429 before the first token may
be retried elsewhere; any other 4xx is the caller's request and retrying cannot fix it.
Closing a stream closes its connection (not back to the pool), so a cancelled caller frees
the vLLM slot at once instead of leaving the pod generating for nobody. A stream that ended
with [DONE] keeps its connection: the few bytes that end the HTTP body are read in the
background, so the next request skips a TCP connect (and the pod an accept).

No redirect is ever followed: a member answering 3xx would otherwise make us re-send the
whole prompt to a host nobody configured and label its answer with the member's name. A
3xx is a failure of that pod (retryable, like a 5xx). Everything the pod says that reaches
an error (its body, reason phrase, Location, an error event) is redacted, then clipped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp
from multidict import CIMultiDict

from prefix_sidecar import __version__
from prefix_sidecar.upstream.body import SplicedBody
from prefix_sidecar.upstream.lean_http import LeanAnswer, LeanHTTP
from prefix_sidecar.upstream.sse import POD_ERROR_CHARS, Delta, SSEDecoder, SSEProtocolError, clip

READ_CHUNK = 64 * 1024
# After [DONE] the end of the HTTP body (the chunked terminator) is normally already read or
# microseconds behind; a pod that takes longer, or sends more than this, loses the connection.
DRAIN_TIMEOUT_S = 1.0
DRAIN_MAX_BYTES = 64 * 1024
MAX_ERROR_BYTES = 1024


LOAD_FORMAT_HEADER = "endpoint-load-metrics-format"  # asks the pod for its load ...
LOAD_HEADER = "endpoint-load-metrics"  # ... which vLLM answers with (ORCA, docs/load-signals.md)


class LoadObserver(Protocol):
    """Where the pods' load reports go (prefix_sidecar.membership.load_signals.LoadSignals)."""

    def note_sent(self, url: str) -> None: ...

    def observe_header(self, url: str, value: str | None) -> None: ...


def retryable_status(status: int) -> bool:
    """Whether another pod may succeed where this status failed: overloaded (429) or broken
    (5xx). Any other 4xx is the caller's request."""
    return status == 429 or status >= 500


class UpstreamError(Exception):
    """A pod could not serve the request. `retryable`: another pod may succeed."""

    def __init__(
        self,
        backend: str,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        connection_failure: bool = False,
    ) -> None:
        message = clip(message, MAX_ERROR_BYTES)  # a last guard; pod words are clipped first
        super().__init__(f"{backend}: {message}")
        self.backend = backend
        self.message = message
        self.retryable = retryable
        self.status = status
        self.connection_failure = connection_failure


class UpstreamStream:
    """One open streaming response; iterate for coalesced deltas."""

    def __init__(
        self,
        backend: str,
        response: aiohttp.ClientResponse,
        chat: bool,
        redact: Callable[[str], str] = str,
        recycle: Callable[[aiohttp.ClientResponse], None] = aiohttp.ClientResponse.release,
        *,
        raw_events: bool = False,
    ) -> None:
        self.backend = backend
        self._redact = redact
        self._recycle = recycle
        self._response = response
        self._decoder = SSEDecoder(chat=chat, raw=raw_events)
        self.finished = False

    async def next_delta(self) -> Delta:
        """Wait for the next read from the pod and return the events it completed (at most
        one decoder slice: a fast pod must not hold the event loop)."""
        while True:
            if self._decoder.pending_error:
                raise UpstreamError(self.backend, self._decoder.pending_error, retryable=True)
            if self._decoder.backlog:
                # More is buffered than one slice: let other streams and calls run first
                # (readany() does not yield while data is buffered).
                await asyncio.sleep(0)
                data = b""
            else:
                data = await self._read()
            try:
                delta = self._decoder.feed(data)
            except SSEProtocolError as exc:
                raise UpstreamError(self.backend, str(exc), retryable=True) from None
            if delta.error:
                message = f"the pod reported an error: {clip(self._redact(delta.error))}"
                if not (delta.text or delta.finish_reason):
                    raise UpstreamError(self.backend, message, retryable=True)
                self._decoder.pending_error = message  # after relaying the text before it
            if delta.events or delta.done:
                if delta.done:
                    self.finished = True
                return delta

    async def _read(self) -> bytes:
        try:
            data = await self._response.content.readany()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise UpstreamError(
                self.backend,
                f"stream broke: {exc.__class__.__name__}: {clip(self._redact(str(exc)))}",
                retryable=True,
            ) from None
        except TimeoutError:  # the request's total timeout (the caller's deadline)
            raise UpstreamError(
                self.backend, "the upstream timeout expired mid-stream", retryable=True
            ) from None
        if not data:
            raise UpstreamError(
                self.backend, "the pod closed the stream before [DONE]", retryable=True
            )
        return data

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delta]:
        while not self.finished:
            yield await self.next_delta()

    def close(self) -> None:
        """Drop the connection unless the stream ended cleanly (then it is reusable)."""
        if self.finished:
            self._recycle(self._response)
        else:
            self._response.close()


class UpstreamClient:
    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        per_backend_connections: int = 512,
        api_key: str = "",
        trace_configs: Sequence[aiohttp.TraceConfig] = (),
        load_observer: LoadObserver | None = None,
    ) -> None:
        """With a `load_observer`, every request asks the pod for its load report (vLLM's
        `endpoint-load-metrics-format: TEXT`) and every answer's report is handed to it."""
        self._connect_timeout_s = connect_timeout_s
        self.load_observer = load_observer
        self._trace_configs = list(trace_configs)
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
        self._session: aiohttp.ClientSession | None = None
        self._draining: set[asyncio.Task[None]] = set()
        # The HTTP front's pod requests to http:// pods (prefix_sidecar.upstream.lean_http).
        self.lean = LeanHTTP(
            connect_timeout_s=connect_timeout_s, per_backend=per_backend_connections
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=self._per_backend, enable_cleanup_closed=True
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s),
                trace_configs=self._trace_configs or None,
            )
        return self._session

    async def close(self) -> None:
        for task in list(self._draining):
            task.cancel()
        if self._draining:
            await asyncio.gather(*self._draining, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.lean.close()

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
        response = await self.post(
            backend,
            path,
            body,
            self._with_own(headers) if headers else self._headers,
            timeout_s=timeout_s,
        )
        if response.status != 200:
            raise await self.refusal(backend, response)
        return UpstreamStream(
            backend, response, chat, self._redact, self._recycle, raw_events=raw_events
        )

    async def post(
        self,
        backend: str,
        path: str,
        body: bytes | SplicedBody,
        headers: Mapping[str, str],
        *,
        timeout_s: float | None,
    ) -> aiohttp.ClientResponse:
        """POST `body` with exactly `headers` and return the response once its headers are
        in, whatever its status but a redirect; UpstreamError (retryable) when the pod cannot
        be reached or answers 3xx. Both fronts send through here."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_timeout_s)
        observer = self.load_observer
        if observer is not None:
            observer.note_sent(backend)
            headers = self._asking_load(headers)
        try:
            response = await self.session.post(
                backend + path,
                data=body,
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
            )
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(
                backend,
                f"cannot connect: {exc.os_error or exc}",
                retryable=True,
                connection_failure=True,
            ) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(
                backend,
                f"request failed: {exc.__class__.__name__}: {clip(self._redact(str(exc)))}",
                retryable=True,
                connection_failure=isinstance(exc, aiohttp.ServerDisconnectedError),
            ) from None
        if 300 <= response.status < 400:
            location = clip(self._redact(response.headers.get("Location", "")), 200)
            response.close()  # its body is not worth reading: the connection goes
            raise UpstreamError(
                backend,
                f"HTTP {response.status} redirect to {location or '(no Location)'}: "
                "the sidecar does not follow redirects from a pod",
                retryable=True,
                status=response.status,
            )
        if observer is not None:
            observer.observe_header(backend, response.headers.get(LOAD_HEADER))
        return response

    async def refusal(self, backend: str, response: aiohttp.ClientResponse) -> UpstreamError:
        """The error of a pod that answered neither 200 nor 3xx, in its own (redacted, clipped)
        words; its connection is released. Retryable for a 429 or a 5xx."""
        message = clip(self._redact(await _error_message(response)))
        response.release()
        return UpstreamError(
            backend,
            f"HTTP {response.status}: {message}",
            retryable=retryable_status(response.status),
            status=response.status,
        )

    async def post_lean(
        self,
        backend: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        timeout_s: float,
    ) -> LeanAnswer:
        """post() through the lean client (the HTTP front's http:// pods): the same load
        report asked for and handed on; the lean client bounds the answer's headers."""
        observer = self.load_observer
        if observer is None:
            return await self.lean.post(backend, path, body, headers, timeout_s=timeout_s)
        observer.note_sent(backend)
        answer = await self.lean.post(
            backend, path, body, self._asking_load(headers), timeout_s=timeout_s
        )
        observer.observe_header(backend, answer.headers.get(LOAD_HEADER))
        return answer

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

    def _recycle(self, response: aiohttp.ClientResponse) -> None:
        """Return a finished response's connection to the pool once its body has ended."""
        if response.content.is_eof():
            response.release()
            return
        task = asyncio.get_running_loop().create_task(_drain(response))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    def _redact(self, text: str) -> str:
        """A careless pod may echo the Authorization header in its error: the key must not
        reach callers or logs through the pod's words."""
        return text.replace(self._api_key, "[redacted]") if self._api_key else text

    redact = _redact

    async def get_json(self, backend: str, path: str, timeout_s: float) -> Any:
        async with self.session.get(
            backend + path,
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            allow_redirects=False,
        ) as response:
            if 300 <= response.status < 400:
                raise UpstreamError(
                    backend,
                    f"HTTP {response.status}: the sidecar does not follow redirects from a pod",
                    retryable=True,
                    status=response.status,
                )
            response.raise_for_status()
            return await response.json(content_type=None)


async def _drain(response: aiohttp.ClientResponse) -> None:
    """Read what follows [DONE] up to the end of the body, then release (reuse) the
    connection; close it instead if the body does not end soon and small."""
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            left = DRAIN_MAX_BYTES
            while left > 0 and (data := await response.content.readany()):
                left -= len(data)
    except (TimeoutError, aiohttp.ClientError):
        pass
    finally:
        if response.content.is_eof():
            response.release()
        else:
            response.close()


async def _error_message(response: aiohttp.ClientResponse) -> str:
    """The pod's own words: vLLM's {"message": ...} or {"error": {"message": ...}}. Longer
    than what reaches a status: the caller redacts before it clips."""
    reason = (response.reason or "no body")[:POD_ERROR_CHARS]
    try:
        raw = await asyncio.wait_for(response.content.read(64 * 1024), timeout=2.0)
    except (TimeoutError, aiohttp.ClientError):
        return reason
    return error_words(raw, reason)


def error_words(raw: bytes, reason: str) -> str:
    """What a pod's error body says: vLLM's {"message": ...} or {"error": {"message": ...}},
    else its text, else `reason`."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:POD_ERROR_CHARS] or reason
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:POD_ERROR_CHARS]
        if isinstance(error, str):
            return error[:POD_ERROR_CHARS]
        for key in ("message", "detail"):
            if data.get(key):
                return str(data[key])[:POD_ERROR_CHARS]
    return text[:POD_ERROR_CHARS]
