"""The large-body reader (ijson, a slice per step of the loop) reads what json.loads reads:
the same routing fields, the same 400s; and it stays linear in the body's size."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from prefix_sidecar.prefixes import PrefixStore
from prefix_sidecar.server.openai import body_steps
from prefix_sidecar.server.openai.body import MAX_DEPTH, FrontError, FrontRequest, parse_request
from prefix_sidecar.server.openai.body_steps import SYNC_BYTES
from prefix_sidecar.server.openai.body_steps import read_request as front_read


async def read_request(raw: bytes, *, chat: bool, store: PrefixStore | None = None) -> FrontRequest:
    """The front's read, with parse_request's default window and turns."""
    return await front_read(raw, chat=chat, store=store, window=4096, turns=True)


# An unknown field that takes a body over SYNC_BYTES, so read_request reads it with ijson.
PAD = b'"pad": [' + b"0," * (SYNC_BYTES // 2) + b"0]"


def large(fields: bytes) -> bytes:
    """The object `fields` ({...}) with PAD first among its keys."""
    assert fields.startswith(b"{")
    return b"{" + PAD + (b", " + fields[1:] if fields != b"{}" else b"}")


def outcome(read: FrontRequest | FrontError) -> tuple[Any, ...]:
    if isinstance(read, FrontError):
        return ("error", read.status, read.param, read.message.split(":")[0])
    return (read.model, read.route_text, read.stream, read.messages, read.answers)


def whole(raw: bytes, chat: bool) -> tuple[Any, ...]:
    try:
        return outcome(parse_request(raw, chat=chat))
    except FrontError as error:
        return outcome(error)


async def stepped(raw: bytes, chat: bool) -> tuple[Any, ...]:
    assert len(raw) > SYNC_BYTES
    try:
        return outcome(await read_request(raw, chat=chat, store=PrefixStore()))
    except FrontError as error:
        return outcome(error)


COMPLETIONS = [
    b'{"model": "m", "prompt": "hi", "stream": true}',
    b'{"prompt": ["a", "b"]}',
    b'{"prompt": [1, 22, 333]}',
    b'{"prompt": [[5, 6], [7]]}',
    b'{"prompt": [1, true]}',
    b'{"prompt": [true]}',
    b'{"prompt": [1, "a"]}',
    b'{"prompt": [1.5]}',
    b'{"prompt": [1, 1.5]}',
    b'{"prompt": [[1, true, "x"]]}',  # a non-integer outranks the bool: "is required"
    b'{"prompt": [[1, true]]}',
    b'{"prompt": [[]]}',
    b'{"prompt": []}',
    b'{"prompt": {"a": 1}}',
    b'{"prompt": null}',
    b'{"prompt": [null]}',
    b'{"prompt": [{}]}',
    b'{"prompt": [1, [2]]}',
    b'{"prompt": [1, {}]}',
    b'{"prompt": "a", "prompt": [3]}',  # a repeated key: the last is read
    b'{"prompt": [3], "prompt": "a"}',
    b'{"model": 3, "prompt": "p"}',
    b'{"model": [1], "prompt": "p"}',
    b'{"prompt": "p", "stream": "yes"}',
    b'{"prompt": "p", "stream": null}',
    b'{"prompt": "p", "stream": {}}',
    b'{"model": "m"}',
    b'{"meta": {"prompt": "x", "model": "n"}, "prompt": "y"}',
    b'{"prompt": "p", "x": [[[[{"a": [1, {"b": 2}]}]]]], "messages": 5}',
    b'{"prompt": "\\u00e9\\ud83d\\ude00 \\" \\\\"}',
    b'{"prompt": [' + b",".join(b"%d" % i for i in range(3000)) + b"]}",
    b'{"prompt": [[' + b",".join(b"%d" % i for i in range(3000)) + b'], "x"]}',
    b'{"prompt": "p", "n": 1.5e300, "big": 9223372036854775806, "neg": -0.0}',
]
CHATS = [
    b'{"messages": [{"role": "system", "content": "rules"}, {"role": "user", "content": "q"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
    b' {"type": "image_url"}, {"text": 5}, {"text": "b", "text": "c"}, "s", ["t"]]}]}',
    b'{"messages": [{"role": "assistant", "content": null}]}',
    b'{"messages": []}',
    b'{"messages": ["hi"]}',
    b'{"messages": [{"content": 5}]}',
    b'{"messages": [{"content": {}}]}',
    b'{"messages": [[1]]}',
    b'{"messages": {}}',
    b'{"model": "m"}',
    b'{"messages": [{"role": "user", "content": "a"}, 5, [2], {"role": ["assistant"]},'
    b' {"role": "assistant", "role": "user"}, {"role": "user", "role": "assistant"}]}',
    b'{"messages": [{"role": "system", "content": "x"}],'
    b' "messages": [{"role": "assistant", "content": "y"}]}',
    json.dumps(
        {
            "messages": [
                {"role": "assistant" if i % 3 == 0 else "user", "content": [{"text": str(i)}]}
                for i in range(100)
            ]
        }
    ).encode(),
    b'{"messages": [{"content": "x"}], "prompt": [true]}',
]


@pytest.mark.parametrize(
    ("raw", "chat"), [(raw, False) for raw in COMPLETIONS] + [(raw, True) for raw in CHATS]
)
async def test_a_large_body_reads_as_json_loads_reads_it(raw: bytes, chat: bool) -> None:
    """Token ids read as their head (the route window's worth of their text)."""
    body = large(raw)
    read, expected = await stepped(body, chat), whole(body, chat)
    if read[0] == "error" or len(expected[1]) <= 4096:
        assert read == expected
    else:
        assert read[:1] + read[2:] == expected[:1] + expected[2:]
        assert expected[1].startswith(read[1]) and len(read[1]) > 4096


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"[" + PAD[8:-1], "not valid JSON"),  # cut short
        (large(b'{"prompt": "p"}') + b" x", "not valid JSON"),
        (large(b'{"prompt": "p",}'), "not valid JSON"),
        (large(b'{"prompt": "\xff"}'), "not UTF-8"),
        (large(b'{"prompt": "\xed\xa0\x80"}'), "not UTF-8"),  # a lone surrogate
        (large(b'{"prompt": "p", "x": NaN}'), "not valid JSON"),
        (  # UTF-16 with a lone surrogate
            large(b'{"prompt": "p"}')
            .decode()
            .replace('"p"', '"\ud800"')
            .encode("utf-16-le", "surrogatepass"),
            "not UTF-8",
        ),
        (b"[" + PAD[8:], "must be a JSON object"),
    ],
)
async def test_bad_large_bodies_are_400s(raw: bytes, words: str) -> None:
    with pytest.raises(FrontError) as caught:
        await read_request(raw, chat=False)
    assert caught.value.status == 400 and words in caught.value.message


async def test_a_number_past_64_bits_is_a_400_not_a_crash() -> None:
    """ijson's exact numbers put a NULL in the event for an integer over 4,300 digits (the
    interpreter's limit) and the process crashed; read as yajl reads them, it is a 400."""
    for number in (b"9" * 5000, b"9" * 20, b"1e400"):
        with pytest.raises(FrontError) as caught:
            await read_request(large(b'{"prompt": "p", "n": ' + number + b"}"), chat=False)
        assert caught.value.status == 400 and "not valid JSON" in caught.value.message


async def test_nesting_is_read_to_max_depth() -> None:
    def nested(levels: int) -> bytes:  # `levels` arrays inside the object
        return large(b'{"prompt": "p", "x": ' + b"[" * levels + b"]" * levels + b"}")

    assert (await read_request(nested(MAX_DEPTH - 1), chat=False)).route_text == "p"
    with pytest.raises(FrontError, match="nests deeper"):
        await read_request(nested(MAX_DEPTH), chat=False)


async def test_a_body_in_utf16_reads_as_json_loads_reads_it() -> None:
    raw = large('{"model": "m", "prompt": "caf\u00e9"}'.encode()).decode().encode("utf-16")
    assert await stepped(raw, False) == whole(raw, False) == ("m", "caf\u00e9", False, (), None)


async def test_a_long_string_costs_linear_time() -> None:
    """yajl lexes a token that spans slices again from its start each slice: 7 MiB of one
    string in 16 KiB slices cost ~10 s of CPU. The slice doubles while no event comes."""
    text = "\x01" * (1024 * 1024)  # 6 MiB escaped
    raw = json.dumps({"prompt": "p", "metadata": text}).encode()
    started = time.thread_time()
    assert (await read_request(raw, chat=False)).route_text == "p"
    assert time.thread_time() - started < 1.0
    assert len(raw) > body_steps.SLICE * 64  # it spanned many slices
