"""Complete and Chat relay the pod's SSE stream as it arrives, coalescing buffered deltas,
and pass the caller's trace headers (traceparent, x-request-id) to the pod and the log."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator import EmulatorConfig, get_stats, run_emulator
from tests.fake_pod import answer_with, recording_pod
from tests.server.conftest import collect, running_sidecar, sidecar_config

RULES = "Platform compliance rule: no absolute claims in promotion copy. " * 400  # ~26 KB


async def test_complete_streams_in_several_chunks_with_backend_first_and_usage_last(
    tmp_path: Path,
) -> None:
    # Slow enough decode (35 tok/s x 20) that 60 tokens span ~15 decode ticks.
    slow = EmulatorConfig(time_scale=20.0)
    async with (
        run_emulator(slow, port=0) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod])) as (_, stub),
    ):
        prefix = await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="r", text=RULES))
        request = router_pb2.CompleteRequest(
            prefix_id=prefix.id, input="Q: 2-for-15%?", max_tokens=60
        )
        first = await collect(stub.Complete(request))
        second = await collect(stub.Complete(request))

    for chunks in (first, second):
        texts = [c.text for c in chunks if c.text]
        assert len(texts) >= 3, f"expected a stream of several chunks, got {len(texts)}"
        assert chunks[0].backend == pod and chunks[0].attempts == 1
        assert all(not c.backend for c in chunks[1:]), "backend is set on the first chunk only"
        assert [c.HasField("usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
        usage = chunks[-1].usage
        assert usage.completion_tokens == 60
        assert usage.prompt_tokens == (len((RULES + "Q: 2-for-15%?").encode()) + 3) // 4
        # Coalescing: a gRPC message never carries less than one SSE event.
        assert len(chunks) <= usage.completion_tokens + 1
        assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
        assert sum(len(t.split()) for t in texts) == 60  # one word per token, none lost
    # The first request prefilled the prefix; the second found it in the pod's cache.
    assert first[-1].usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens >= len(RULES) // 4 - 16


async def test_buffered_deltas_are_coalesced(tmp_path: Path) -> None:
    # At 1000x, 200 tokens are decoded within a few 5 ms ticks: the pod writes 200 events
    # much faster than they are relayed, so they arrive buffered and must be merged.
    fast = EmulatorConfig(time_scale=1000.0)
    async with (
        run_emulator(fast, port=0) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod])) as (_, stub),
    ):
        chunks = await collect(
            stub.Complete(router_pb2.CompleteRequest(input="coalesce me", max_tokens=200))
        )
    assert chunks[-1].usage.completion_tokens == 200
    assert sum(len(c.text.split()) for c in chunks) == 200
    assert len(chunks) < 200 / 4, f"{len(chunks)} messages for 200 SSE events: not coalesced"


async def test_chat_sends_the_prefix_as_the_system_message(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pod = await stack.enter_async_context(run_emulator(EmulatorConfig(time_scale=1000.0)))
        _, stub = await stack.enter_async_context(running_sidecar(sidecar_config(tmp_path, [pod])))
        await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=RULES))

        async def chat(question: str) -> list[Any]:
            request = router_pb2.ChatRequest(
                prefix_name="rules",
                messages=[router_pb2.ChatMessage(role="user", content=question)],
                max_tokens=12,
            )
            return await collect(stub.Chat(request))

        first = await chat("draft a live-stream script")
        second = await chat("is 499 yuan -15% allowed?")
        stats = await get_stats(pod)

    for chunks in (first, second):
        assert chunks[0].backend == pod
        assert "".join(c.text for c in chunks).strip()
        assert chunks[-1].usage.completion_tokens == 12
    # ChatML renders the system message first: "<|im_start|>system\n" + RULES + ...; the
    # second chat shares that whole head with the first, whatever the user asked.
    system_tokens = len(("<|im_start|>system\n" + RULES).encode()) // 4
    assert second[-1].usage.cached_tokens >= system_tokens - 16
    assert first[-1].usage.prompt_tokens > system_tokens
    fingerprints = {p["fingerprint"] for p in stats["prefills"]}
    assert len(fingerprints) == 1, "both chats must start with the same (system) block"


# --- the caller's trace headers --------------------------------------------------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def call(stub: Any, rpc: str, metadata: tuple[tuple[str, str], ...]) -> Any:
    if rpc == "Chat":
        chat = router_pb2.ChatRequest(messages=[router_pb2.ChatMessage(role="user", content="q")])
        return stub.Chat(chat, metadata=metadata)
    return stub.Complete(router_pb2.CompleteRequest(input="q"), metadata=metadata)


def request_lines(caplog: pytest.LogCaptureFixture, rpc: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(rpc + " ")]


@pytest.mark.parametrize("rpc", ["Complete", "Chat"])
async def test_trace_headers_from_the_callers_metadata_reach_the_pod_and_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, rpc: str
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.requests")
    metadata = (("traceparent", TRACEPARENT), ("x-request-id", "order-7f3a"))
    async with (
        recording_pod(answer_with("ok")) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod.url])) as (_, stub),
    ):
        chunks = await collect(call(stub, rpc, metadata))
        plain = await collect(call(stub, rpc, ()))
    assert "".join(c.text for c in chunks) == "ok" and plain
    assert pod.headers[0]["traceparent"] == TRACEPARENT
    assert pod.headers[0]["x-request-id"] == "order-7f3a"
    assert "traceparent" not in pod.headers[1] and "x-request-id" not in pod.headers[1]
    traced, untraced = request_lines(caplog, rpc)
    assert traced.endswith(f"traceparent={TRACEPARENT} request_id=order-7f3a"), traced
    assert untraced.endswith("traceparent=- request_id=-"), untraced


async def test_malformed_trace_headers_are_dropped_and_the_call_still_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.requests")
    metadata = (
        ("traceparent", TRACEPARENT.upper()),
        ("x-request-id", "two words status=OK"),  # would forge a field in the log line
    )
    async with (
        recording_pod(answer_with("ok")) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod.url])) as (_, stub),
    ):
        chunks = await collect(call(stub, "Complete", metadata))
        long_id = await collect(call(stub, "Complete", (("x-request-id", "r" * 129),)))
    assert chunks[-1].finish_reason == "stop" and long_id
    assert all("traceparent" not in headers for headers in pod.headers)
    assert all("x-request-id" not in headers for headers in pod.headers)
    lines = request_lines(caplog, "Complete")
    assert len(lines) == 2
    assert all(line.endswith("traceparent=- request_id=-") for line in lines), lines
