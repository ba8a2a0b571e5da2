"""extra_json and raw_events over real gRPC to a real sidecar and a recording pod on
127.0.0.1 (tests/fake_pod.py): extra members reach the pod byte for byte, a bad extra_json
is refused with a status that says what to fix, and raw_events returns the pod's event JSON
unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web

from prefix_sidecar.v1 import router_pb2
from tests.fake_pod import Handler, recording_pod, respond, sse
from tests.server.conftest import collect, running_sidecar, sidecar_config
from tests.upstream.test_chunks import joined_events

RULES = "Compliance rule: no absolute claims in promotion copy. " * 200
# Key order, number spelling, nesting and spacing the pod must see unchanged.
EXTRA = (
    ' {"response_format": {"type": "json_schema", "json_schema": {"name": "verdict",'
    ' "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}},'
    ' "logprobs": true, "top_logprobs": 2, "min_p": 1.0e-3, "n": 2,'
    ' "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]} '
)
MEMBERS = EXTRA.strip()[1:-1].strip().encode()

CHAT_EVENTS = [
    '{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
    '{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1",'
    '"type":"function","function":{"name":"lookup","arguments":""}}]},"logprobs":null}]}',
    '{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
    '{"arguments":"{\\"sku\\": 499}"}}]}}]}',
    '{"id":"c1","choices":[{"index":1,"delta":{"content":"\u4e2d"},"logprobs":{"content":'
    '[{"token":"\u4e2d","logprob":-1.0e-3,"top_logprobs":[]}]}}],  "x": 1E5}',
    '{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"},'
    '{"index":1,"delta":{},"finish_reason":"stop"}]}',
    '{"id":"c1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}',
]

COMPLETION_EVENTS = [
    '{"id":"k1","choices":[{"index":0,"text":"ok","logprobs":{"tokens":["ok"],'
    '"token_logprobs":[-1.0e-3],"top_logprobs":[{"ok":-1.0e-3}]}},'
    '{"index":1,"text":"no","logprobs":null}]}',
    '{"id":"k1","choices":[{"index":0,"text":"","finish_reason":"stop"},'
    ' {"index":1,"text":"","finish_reason":"length"}]}',
    '{"id":"k1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}',
]


def answering(chat_events: list[str]) -> Handler:
    """A pod's answer: chat with `chat_events`, completions with COMPLETION_EVENTS (JSON
    texts, sent as they are)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        return await respond(sse(*(chat_events if chat else COMPLETION_EVENTS)))(request)

    return answer


def request_for(rpc: str, prefix: dict[str, Any], **fields: Any) -> Any:
    if rpc == "Chat":
        user = router_pb2.ChatMessage(role="user", content="is 'best ever' allowed?")
        return router_pb2.ChatRequest(**prefix, messages=[user], **fields)
    return router_pb2.CompleteRequest(**prefix, input="is 'best ever' allowed?", **fields)


async def call(stub: Any, rpc: str, request: Any) -> list[router_pb2.Chunk]:
    return await collect(getattr(stub, rpc)(request))


@pytest.mark.parametrize("rpc", ["Complete", "Chat"])
@pytest.mark.parametrize("registered", [True, False], ids=["registered", "no_prefix"])
async def test_extra_json_members_reach_the_pod_byte_for_byte(
    tmp_path: Path, rpc: str, registered: bool
) -> None:
    async with (
        recording_pod(answering(CHAT_EVENTS)) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod.url], model="cfg")) as (_, stub),
    ):
        prefix: dict[str, str] = {}
        if registered:
            await stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="rules", text=RULES))
            prefix = {"prefix_name": "rules"}
        await call(stub, rpc, request_for(rpc, prefix, max_tokens=4, extra_json=EXTRA))
    [body] = pod.bodies
    assert body.endswith(b"," + MEMBERS + b"}")
    data = json.loads(body)
    assert data["max_tokens"] == 4 and data["model"] == "cfg" and data["stream"] is True
    assert data["n"] == 2 and data["min_p"] == 1.0e-3
    assert list(data)[-6:] == ["response_format", "logprobs", "top_logprobs", "min_p", "n", "tools"]
    head = RULES if registered else ""
    if rpc == "Chat":
        assert data["messages"][-1]["content"] == "is 'best ever' allowed?"
        assert (data["messages"][0]["content"] == RULES) is registered
    else:
        assert data["prompt"] == head + "is 'best ever' allowed?"


@pytest.mark.parametrize("rpc", ["Complete", "Chat"])
async def test_a_model_or_sampling_key_in_extra_json_is_used_when_the_field_is_unset(
    tmp_path: Path, rpc: str
) -> None:
    extra = '{"model": "other", "temperature": 0.0, "stop": ["\\n"]}'
    async with (
        recording_pod(answering(CHAT_EVENTS)) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod.url], model="cfg")) as (_, stub),
    ):
        await call(stub, rpc, request_for(rpc, {}, extra_json=extra))
        await call(stub, rpc, request_for(rpc, {}, extra_json=" {} "))
    with_extra, empty = (json.loads(body) for body in pod.bodies)
    assert with_extra["model"] == "other" and with_extra["stop"] == ["\n"]
    assert pod.bodies[0].count(b'"model"') == 1
    assert empty["model"] == "cfg" and "temperature" not in empty


BAD_EXTRA = [
    ("[1, 2]", "extra_json is a JSON array, not an object"),
    ('"text"', "extra_json is a JSON string, not an object"),
    ('{"n": 2', "extra_json is not valid JSON"),
    ('{"n": NaN}', "extra_json is not valid JSON"),
    ('{"n": 1, "n": 2}', "extra_json sets 'n' twice"),
    ('{"stream": false}', "extra_json sets 'stream', which the sidecar writes itself"),
    ('{"stream_options": {}}', "extra_json sets 'stream_options', which the sidecar writes"),
    ('{"max_tokens": 9}', "extra_json sets 'max_tokens' and so does the request's max_tokens"),
    ('{"model": "m"}', "extra_json sets 'model' and so does the request's model"),
    ("{" + '"k": "' + "x" * 5000 + '"}', "extra_json is 5009 bytes; the maximum is 4096 bytes"),
]


@pytest.mark.parametrize("rpc", ["Complete", "Chat"])
async def test_a_bad_extra_json_is_invalid_argument_saying_what_to_fix(
    tmp_path: Path, rpc: str
) -> None:
    owned = "prompt" if rpc == "Complete" else "messages"
    cases = [
        *BAD_EXTRA,
        (f'{{"{owned}": 1}}', f"extra_json sets '{owned}', which the sidecar writes itself"),
    ]
    refused: list[tuple[grpc.StatusCode, str]] = []
    async with (
        recording_pod(answering(CHAT_EVENTS)) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod.url], max_input_bytes=4096)) as (_, stub),
    ):
        for extra, _ in cases:
            request = request_for(rpc, {}, max_tokens=3, model="m", extra_json=extra)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(stub, rpc, request)
            refused.append((caught.value.code(), caught.value.details() or ""))
    for (code, details), (_, message) in zip(refused, cases, strict=True):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, details
    assert not pod.bodies  # refused before any pod is asked


@pytest.mark.parametrize("rpc", ["Complete", "Chat"])
async def test_raw_events_return_the_pods_event_json_unchanged(tmp_path: Path, rpc: str) -> None:
    async with (
        recording_pod(answering(CHAT_EVENTS)) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod.url])) as (_, stub),
    ):
        raw = await call(stub, rpc, request_for(rpc, {}, raw_events=True))
        plain = await call(stub, rpc, request_for(rpc, {}))
    sent, text = (CHAT_EVENTS, "\u4e2d") if rpc == "Chat" else (COMPLETION_EVENTS, "okno")
    assert joined_events(raw) == sent
    assert "".join(c.text for c in raw) == "".join(c.text for c in plain) == text
    assert raw[0].backend == pod.url
    assert raw[-1].finish_reason and raw[-1].usage.completion_tokens == 3
    assert not any(c.events for c in plain)


async def test_a_huge_raw_event_is_split_under_the_message_limit(tmp_path: Path) -> None:
    limit = 64 * 1024
    huge = json.dumps(
        {"choices": [{"index": 0, "delta": {"content": "\u4e2d" * 60_000}}]}, ensure_ascii=False
    )
    events = [CHAT_EVENTS[0], '{"choices":[{"index":0,"delta":{"content":"a"}}]}', huge]
    async with (
        recording_pod(answering(CHAT_EVENTS)) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod.url], max_message_bytes=limit)) as (
            _,
            stub,
        ),
    ):
        events = [*events, CHAT_EVENTS[-2], CHAT_EVENTS[-1]]
        pod.handler = answering(events)
        chunks = await call(stub, "Chat", request_for("Chat", {}, raw_events=True))
    assert joined_events(chunks) == events
    assert "".join(c.text for c in chunks) == "a" + "\u4e2d" * 60_000
    assert len(chunks) > 6 and all(c.ByteSize() <= limit for c in chunks)
    assert any(c.event_continues for c in chunks)


async def test_raw_events_held_before_the_first_token_are_bounded(tmp_path: Path) -> None:
    """A pod that sends many events without text: past a Chunk's worth they are sent, not
    held until the first token."""
    limit = 64 * 1024
    filler = [
        f'{{"choices":[{{"index":0,"delta":{{"role":"assistant"}}}}],"i":{i}}}' for i in range(3000)
    ]
    async with (
        recording_pod(answering(CHAT_EVENTS)) as pod,
        running_sidecar(sidecar_config(tmp_path, [pod.url], max_message_bytes=limit)) as (
            _,
            stub,
        ),
    ):
        events = [*filler, *CHAT_EVENTS[3:]]
        pod.handler = answering(events)
        chunks = await call(stub, "Chat", request_for("Chat", {}, raw_events=True))
    assert joined_events(chunks) == events
    assert len(chunks) > 2 and all(c.ByteSize() <= limit for c in chunks)
    assert not chunks[0].text  # sent before any text arrived
