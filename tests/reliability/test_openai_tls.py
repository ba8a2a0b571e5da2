"""The OpenAI HTTP front off loopback serves TLS only, with the gRPC TCP listener's files."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from prefix_sidecar_tools.harness import free_port
from tests.fake_pod import StartPod

StartSidecar = Callable[..., contextlib.AbstractAsyncContextManager[Any]]


async def test_a_non_loopback_openai_front_serves_tls_and_refuses_plaintext(
    certs: Any, fake_pod: StartPod, start_sidecar: StartSidecar
) -> None:
    pod, port = await fake_pod(), free_port()
    fields = {
        "openai_listen": f"0.0.0.0:{port}",
        "tls_cert_file": str(certs.server_cert),
        "tls_key_file": str(certs.server_key),
    }
    async with start_sidecar([pod.url], **fields), aiohttp.ClientSession() as session:
        trusted = ssl.create_default_context(cafile=str(certs.ca))
        body = {"model": "m", "prompt": "over tls", "stream": True}
        async with session.post(
            f"https://127.0.0.1:{port}/v1/completions", json=body, ssl=trusted
        ) as reply:
            assert reply.status == 200
            assert (await reply.read()).endswith(b"data: [DONE]\n\n")
        assert pod.bodies[-1] == b'{"model": "m", "prompt": "over tls", "stream": true}'
        with pytest.raises(aiohttp.ClientError):
            async with session.get(f"http://127.0.0.1:{port}/health") as plain:
                await plain.read()
        untrusted = ssl.create_default_context(cafile=str(certs.other_ca))
        with pytest.raises(aiohttp.ClientError):
            await session.get(f"https://127.0.0.1:{port}/health", ssl=untrusted)
