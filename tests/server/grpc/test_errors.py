"""Each refusal has its documented status and a message that says what to fix."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import set_faults
from tests.server.conftest import (
    backend_states,
    collect,
    requests_per_pod,
    running_sidecar,
    sidecar_config,
    wait_for,
)


async def status_of(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call
        if hasattr(result, "__aiter__"):
            await collect(result)
        else:
            await result
    return info.value.code(), info.value.details() or ""


async def test_unknown_prefix_is_not_found(sidecar: Sidecar, stub: Any) -> None:
    calls = [
        stub.Complete(router_pb2.CompleteRequest(prefix_id="ab" * 32, input="q")),
        stub.Complete(router_pb2.CompleteRequest(prefix_name="nope", input="q")),
        stub.Chat(
            router_pb2.ChatRequest(
                prefix_name="nope", messages=[router_pb2.ChatMessage(role="user", content="q")]
            )
        ),
        stub.Route(router_pb2.RouteRequest(prefix_name="nope")),
        stub.Prewarm(router_pb2.PrewarmRequest(prefix_id="nope")),
        stub.UnregisterPrefix(router_pb2.UnregisterPrefixRequest(prefix_id="nope")),
    ]
    for call in calls:
        code, details = await status_of(call)
        assert code == grpc.StatusCode.NOT_FOUND, details
        assert "register" in details.lower()


async def test_no_prefix_and_empty_input_is_invalid_argument(sidecar: Sidecar, stub: Any) -> None:
    code, details = await status_of(stub.Complete(router_pb2.CompleteRequest(max_tokens=3)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "empty input" in details and "prefix_id" in details
    code, details = await status_of(stub.Chat(router_pb2.ChatRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, details = await status_of(stub.Route(router_pb2.RouteRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field, written by hand so it can hold invalid UTF-8."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize(
    ("method", "raw"),
    [
        ("Complete", _field(3, b"rules \xff\xfe") + _field(4, b"q")),  # prefix_text
        ("Complete", _field(4, b"\xed\xa0\x80")),  # input: an encoded lone surrogate
        ("Chat", _field(4, _field(1, b"user") + _field(2, b"\xc3("))),  # message content
    ],
)
async def test_invalid_utf8_in_a_string_field_is_invalid_argument(
    sidecar: Sidecar, pods: list[str], method: str, raw: bytes
) -> None:
    before = await requests_per_pod(pods)
    async with grpc.aio.insecure_channel(sidecar.target) as channel:
        call = channel.unary_stream(
            f"/sidecar.v1.Router/{method}",
            request_serializer=lambda data: data,
            response_deserializer=router_pb2.Chunk.FromString,
        )
        code, details = await status_of(call(raw))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "UTF-8" in details
    assert await requests_per_pod(pods) == before


async def test_over_the_maximum_size_is_invalid_argument(tmp_path: Path, pods: list[str]) -> None:
    config = sidecar_config(tmp_path, pods, max_input_bytes=100, max_prefix_bytes=1000)
    async with running_sidecar(config) as (_, stub):
        code, details = await status_of(
            stub.Complete(router_pb2.CompleteRequest(input="x" * 101, max_tokens=1))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "101 bytes" in details and "max_input_bytes" in details
        # Bytes, not characters: 34 x 3-byte characters are 102 bytes.
        code, details = await status_of(
            stub.Complete(router_pb2.CompleteRequest(input="促" * 34, max_tokens=1))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "102 bytes" in details
        code, details = await status_of(
            stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="big", text="r" * 1001))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_prefix_bytes" in details
        code, details = await status_of(
            stub.Chat(
                router_pb2.ChatRequest(
                    messages=[
                        router_pb2.ChatMessage(role="user", content="促" * 20),
                        router_pb2.ChatMessage(role="user", content="促" * 20),
                    ]
                )
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_input_bytes" in details
        ok = await collect(stub.Complete(router_pb2.CompleteRequest(input="x" * 100, max_tokens=1)))
        assert ok[-1].usage.completion_tokens == 1


@pytest.mark.parametrize(
    ("fields", "pod_words"),
    [
        ({"model": "gpt-5"}, "does not exist"),
        ({"max_tokens": 200_000}, "maximum context length"),
    ],
)
async def test_pod_rejecting_the_parameters_is_invalid_argument_with_its_message(
    sidecar: Sidecar,
    stub: Any,
    fields: dict[str, Any],
    pod_words: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.requests")
    code, details = await status_of(
        stub.Complete(router_pb2.CompleteRequest(input="hello", **fields))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert pod_words in details, details
    # Retrying cannot fix the caller's request: one attempt, no failover.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Complete ")]
    assert len(lines) == 1 and "attempts=1 status=INVALID_ARGUMENT" in lines[0], lines


async def test_chat_role_the_pod_rejects_is_invalid_argument(sidecar: Sidecar, stub: Any) -> None:
    code, details = await status_of(
        stub.Chat(
            router_pb2.ChatRequest(messages=[router_pb2.ChatMessage(role="robot", content="hi")])
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "role" in details and "user" in details


async def test_no_healthy_pod_is_unavailable(tmp_path: Path, closed_port: int) -> None:
    dead = f"http://127.0.0.1:{closed_port}"
    config = sidecar_config(tmp_path, [dead])
    async with running_sidecar(config, wait=False) as (_, stub):

        async def ejected() -> bool:
            return await backend_states(stub) == {dead: "ejected"}

        await wait_for(ejected, what="the dead pod to be ejected")
        for call in (
            stub.Route(router_pb2.RouteRequest(prompt="hi")),
            stub.Complete(router_pb2.CompleteRequest(input="hi")),
            stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="r", text="t", prewarm=True)),
        ):
            code, details = await status_of(call)
            assert code == grpc.StatusCode.UNAVAILABLE
            assert "pod" in details


async def test_all_pods_unhealthy_is_unavailable(
    sidecar: Sidecar, stub: Any, pods: list[str]
) -> None:
    await asyncio.gather(*(set_faults(url, unhealthy=True) for url in pods))

    async def all_ejected() -> bool:
        return set((await backend_states(stub)).values()) == {"ejected"}

    await wait_for(all_ejected, timeout=5.0, what="every pod to be ejected")
    code, details = await status_of(stub.Complete(router_pb2.CompleteRequest(input="hi")))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "no healthy vLLM pod" in details
