"""An `https://` pod is reached through the one upstream client, its certificate verified
against the CA the client trusts (streams, a control fetch, a sidecar's health checks and
Complete), and refused before any request reaches it when its certificate does not verify."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable
from typing import Any

import pytest

from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.errors import UpstreamError
from tests.fake_pod import complete, recording_pod

StartSidecar = Callable[..., contextlib.AbstractAsyncContextManager[Any]]
BODY = b'{"prompt": "over tls", "stream": true}'


@pytest.fixture
def pod_tls(certs: Any) -> ssl.SSLContext:
    """The pod's side: the server certificate for 127.0.0.1 that the test CA signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.server_cert, certs.server_key)
    return context


async def _stream_text(client: UpstreamClient, url: str) -> str:
    stream = await client.open(url, "/v1/completions", BODY, timeout_s=5.0, chat=False)
    try:
        return "".join([delta.text async for delta in stream])
    finally:
        stream.close()


async def test_an_https_pod_with_a_verified_certificate_is_served(
    certs: Any, pod_tls: ssl.SSLContext
) -> None:
    trusted = ssl.create_default_context(cafile=str(certs.ca))
    assert trusted.verify_mode is ssl.CERT_REQUIRED and trusted.check_hostname
    async with recording_pod(tls=pod_tls) as pod, UpstreamClient(tls_context=trusted) as client:
        assert pod.url.startswith("https://127.0.0.1:")
        assert [await _stream_text(client, pod.url) for _ in range(2)] == ["hello", "hello"]
        health = await client.fetch("GET", pod.url, "/health", timeout_s=5.0, limit=1024)
        assert (health.status, health.body) == (200, b"ok")
    assert pod.bodies == [BODY, BODY]


@pytest.mark.parametrize("trust", ["another CA", "the system's trust store"])
async def test_an_https_pod_whose_certificate_does_not_verify_is_refused(
    certs: Any, pod_tls: ssl.SSLContext, trust: str
) -> None:
    context = (
        ssl.create_default_context(cafile=str(certs.other_ca)) if trust == "another CA" else None
    )
    async with recording_pod(tls=pod_tls) as pod, UpstreamClient(tls_context=context) as client:
        with pytest.raises(UpstreamError, match="TLS certificate does not verify") as refused:
            await _stream_text(client, pod.url)
        assert refused.value.retryable and refused.value.connection_failure
        with pytest.raises(UpstreamError, match="TLS certificate does not verify"):
            await client.fetch("GET", pod.url, "/health", timeout_s=5.0, limit=1024)
    assert pod.bodies == []


async def test_a_sidecar_checks_and_serves_an_https_pod_its_trust_store_holds(
    certs: Any,
    pod_tls: ssl.SSLContext,
    start_sidecar: StartSidecar,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sidecar verifies pods against the system's trust store; SSL_CERT_FILE is how an
    # operator (or this test) names another one.
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
    async with recording_pod(tls=pod_tls) as pod, start_sidecar([pod.url]) as (_, stub):
        chunks, code, message = await complete(stub)
    assert code == "OK", message
    assert chunks[0].backend == pod.url and "".join(c.text for c in chunks) == "hello"
    assert len(pod.bodies) == 1
