"""Fuzz cases: requests encoded as raw protobuf bytes by hand, with the statuses
docs/RELIABILITY.md allows for each RPC and input class.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from prefix_sidecar.v1 import router_pb2

SERVICE = "/sidecar.v1.Router/"

RESPONSES: dict[str, Any] = {
    "RegisterPrefix": router_pb2.Prefix,
    "UnregisterPrefix": router_pb2.UnregisterPrefixReply,
    "ListPrefixes": router_pb2.ListPrefixesReply,
    "Route": router_pb2.RouteReply,
    "Complete": router_pb2.Chunk,
    "Chat": router_pb2.Chunk,
    "Prewarm": router_pb2.PrewarmEvent,
    "ListBackends": router_pb2.ListBackendsReply,
}
RPCS = tuple(RESPONSES)
STREAMING = frozenset({"Complete", "Chat", "Prewarm"})
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MODEL = "fuzz-model"
# Names the fuzz registers and unregisters; the known prefixes never use them.
SCRATCH = tuple(f"scratch-{i}" for i in range(8))
# Never valid UTF-8: a stray continuation byte, an overlong '/', an encoded surrogate, a
# 5-byte form, a truncated 3-byte form, 0xff.
BAD_UTF8 = (b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82", b"\xff")

OK = frozenset({"OK"})
INVALID = frozenset({"INVALID_ARGUMENT"})
NOT_FOUND = frozenset({"NOT_FOUND"})
TOO_BIG = frozenset({"RESOURCE_EXHAUSTED"})
# Random bytes may happen to decode to any request: they get what that request would get.
RANDOM_ALLOWED = {
    "RegisterPrefix": OK | INVALID,
    "UnregisterPrefix": OK | INVALID | NOT_FOUND,
    "ListPrefixes": OK | INVALID,
    "Route": OK | INVALID | NOT_FOUND,
    "Complete": OK | INVALID | NOT_FOUND,
    "Chat": OK | INVALID | NOT_FOUND,
    "Prewarm": OK | INVALID | NOT_FOUND,
    "ListBackends": OK | INVALID,
}


@dataclass(frozen=True)
class Limits:
    """Small size limits, so over-limit cases stay cheap to build and send."""

    max_prefix_bytes: int = 16 * 1024
    max_input_bytes: int = 4 * 1024
    max_message_bytes: int = 64 * 1024


@dataclass(frozen=True)
class Known:
    """Prefixes registered before fuzzing, so valid cases can name them."""

    ids: tuple[str, ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class Case:
    """One encoded request and the statuses documented for its input class."""

    rpc: str
    kind: str
    payload: bytes
    allowed: frozenset[str]

    def __repr__(self) -> str:
        shown = self.payload if len(self.payload) <= 300 else self.payload[:300] + b"..."
        return (
            f"Case(rpc={self.rpc!r}, kind={self.kind!r}, allowed={sorted(self.allowed)}, "
            f"payload[{len(self.payload)}]={shown!r})"
        )


# --- protobuf wire encoding by hand --------------------------------------------------------


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(number: int, data: bytes) -> bytes:
    """One field of wire type 2 (string, bytes or sub-message)."""
    return varint(number << 3 | 2) + varint(len(data)) + data


# --- strategies ----------------------------------------------------------------------------

text = st.text(max_size=40)
nonempty = st.text(min_size=1, max_size=40)
bad_utf8 = st.builds(
    lambda head, bad, tail: head.encode() + bad + tail.encode(),
    st.text(max_size=8),
    st.sampled_from(BAD_UTF8),
    st.text(max_size=8),
)
# Draw one character (1-4 UTF-8 bytes) and repeat it: hypothesis never has to build or
# shrink a 20 KB string character by character.
wide_char = st.characters(codec="utf-8")


def over(limit: int) -> st.SearchStrategy[str]:
    """A string a little over `limit` UTF-8 bytes."""
    return st.builds(
        lambda ch, extra: ch * (limit // len(ch.encode()) + 1 + extra),
        wide_char,
        st.integers(0, 64),
    )


def make(rpc: str, kind: str, allowed: frozenset[str]) -> Callable[[Any], Case]:
    """Message -> Case of this input class."""
    return lambda message: Case(rpc, kind, message.SerializeToString(), allowed)


def bad_field(
    rpc: str, base: st.SearchStrategy[Any], numbers: tuple[int, ...]
) -> st.SearchStrategy[Case]:
    """A valid message with one string field sent again as invalid UTF-8 (for a singular
    field the last value wins, so the server must parse the bad one)."""
    return st.builds(
        lambda m, n, b: Case(
            rpc, "invalid_utf8", m.SerializeToString() + length_delimited(n, b), INVALID
        ),
        base,
        st.sampled_from(numbers),
        bad_utf8,
    )


def random_bytes(rpc: str) -> st.SearchStrategy[Case]:
    """Random bytes as the whole request: every RPC gets them."""
    return st.builds(
        lambda b: Case(rpc, "random_bytes", b, RANDOM_ALLOWED[rpc]), st.binary(max_size=120)
    )


# A string field of each request, to carry an over-size payload (1 for the empty requests:
# an unknown field of their own).
STRING_FIELD = {rpc: 2 for rpc in RPCS} | {"ListPrefixes": 1, "ListBackends": 1, "Route": 3}
STRING_FIELD |= {"Complete": 4, "Chat": 3}


def over_max_message(rpc: str, limits: Limits) -> st.SearchStrategy[Case]:
    """A request over max_message_bytes: gRPC refuses it before any handler runs. Kept out
    of the main mix because grpc is slow to refuse each one (docs/benchmarks.md)."""
    return st.builds(
        lambda extra: Case(
            rpc,
            "over_max_message",
            length_delimited(STRING_FIELD[rpc], b"x" * (limits.max_message_bytes + extra)),
            TOO_BIG,
        ),
        st.integers(1, 4096),
    )


def ref(
    known: Known, *, inline: bool = False, none: bool = True
) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments naming a registered prefix, an inline one, or (optionally) none."""
    options = [
        st.sampled_from(known.ids).map(lambda v: {"prefix_id": v}),
        st.sampled_from(known.names).map(lambda v: {"prefix_name": v}),
    ]
    if inline:
        options.append(text.map(lambda v: {"prefix_text": v}))
    if none:
        options.append(st.just({}))
    return st.one_of(*options)


unknown_ref: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.text(max_size=70).map(lambda v: {"prefix_id": "unknown-" + v}),
    st.text(max_size=40).map(lambda v: {"prefix_name": "unknown-" + v}),
)


def register_cases(known: Known, limits: Limits) -> st.SearchStrategy[Case]:
    rpc, m = "RegisterPrefix", router_pb2.RegisterPrefixRequest
    names = st.one_of(st.sampled_from(SCRATCH), nonempty)
    valid = st.builds(
        m,
        name=names,
        text=st.text(min_size=1, max_size=200),
        replicas=st.integers(0, 8),
        prewarm=st.booleans(),
    )
    return st.one_of(
        valid.map(make(rpc, "valid", OK)),
        st.builds(m, name=names, text=over(limits.max_prefix_bytes // 2)).map(
            make(rpc, "large", OK)
        ),
        st.builds(m, name=st.just(""), text=text).map(make(rpc, "empty_name", INVALID)),
        st.builds(m, name=names, text=st.just("")).map(make(rpc, "empty_text", INVALID)),
        st.builds(m, name=over(1024), text=nonempty).map(make(rpc, "long_name", INVALID)),
        st.builds(m, name=names, text=over(limits.max_prefix_bytes)).map(
            make(rpc, "over_max_prefix", INVALID)
        ),
        st.builds(m, name=names, text=nonempty, replicas=st.integers(1025, 2**32 - 1)).map(
            make(rpc, "huge_replicas", INVALID)
        ),
        bad_field(rpc, valid, (1, 2)),
        random_bytes(rpc),
    )


def unregister_cases(known: Known, limits: Limits) -> st.SearchStrategy[Case]:
    rpc, m = "UnregisterPrefix", router_pb2.UnregisterPrefixRequest
    return st.one_of(
        unknown_ref.map(lambda kw: m(**kw)).map(make(rpc, "unknown_prefix", NOT_FOUND)),
        st.sampled_from(SCRATCH)
        .map(lambda n: m(prefix_name=n))
        .map(make(rpc, "scratch", OK | NOT_FOUND)),
        st.just(m()).map(make(rpc, "empty", INVALID)),
        bad_field(rpc, st.just(m(prefix_name="scratch-0")), (1, 2)),
        random_bytes(rpc),
    )


def list_cases(rpc: str, limits: Limits) -> st.SearchStrategy[Case]:
    m = router_pb2.ListPrefixesRequest if rpc == "ListPrefixes" else router_pb2.ListBackendsRequest
    # Unknown fields are legal protobuf: a newer client's request must still be answered.
    unknown_field = st.builds(
        lambda n, b: Case(rpc, "unknown_field", length_delimited(n, b), OK),
        st.integers(1, 1000),
        st.binary(max_size=40),
    )
    return st.one_of(st.just(m()).map(make(rpc, "valid", OK)), unknown_field, random_bytes(rpc))


def route_cases(known: Known, limits: Limits) -> st.SearchStrategy[Case]:
    rpc, m = "Route", router_pb2.RouteRequest
    return st.one_of(
        ref(known, none=False).map(lambda kw: m(**kw)).map(make(rpc, "valid", OK)),
        st.text(max_size=300).map(lambda p: m(prompt=p)).map(make(rpc, "valid", OK)),
        over((limits.max_prefix_bytes + limits.max_input_bytes) // 2)
        .map(lambda p: m(prompt=p))
        .map(make(rpc, "large", OK)),
        unknown_ref.map(lambda kw: m(**kw)).map(make(rpc, "unknown_prefix", NOT_FOUND)),
        st.just(m()).map(make(rpc, "empty", INVALID)),
        over(limits.max_prefix_bytes + limits.max_input_bytes)
        .map(lambda p: m(prompt=p))
        .map(make(rpc, "over_max_input", INVALID)),
        bad_field(rpc, st.just(m(prompt="hello")), (1, 2, 3)),
        random_bytes(rpc),
    )


@st.composite
def sampling(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """Sampling keyword arguments: all valid, or one broken as `kind` says."""
    kw: dict[str, Any] = {}
    if kind == "bad_temperature":
        kw["temperature"] = draw(st.sampled_from((-1.0, -1e-6, -math.inf, math.inf, math.nan)))
    elif draw(st.booleans()):
        kw["temperature"] = draw(st.floats(0, 2, width=32))
    if kind == "bad_top_p":
        kw["top_p"] = draw(
            st.one_of(st.floats(max_value=0, width=32), st.floats(min_value=1.25, width=32))
        )
    elif draw(st.booleans()):
        kw["top_p"] = draw(st.floats(0.0625, 1.0, width=32))
    if kind == "bad_stop":
        kw["stop"] = draw(
            st.one_of(st.lists(nonempty, min_size=17, max_size=20), st.just(["a", ""]))
        )
    else:
        kw["stop"] = draw(st.lists(st.text(min_size=1, max_size=8), max_size=3))
    if draw(st.booleans()):
        kw["seed"] = draw(st.integers(-(2**63), 2**63 - 1))
    return kw


# extra_json members the emulator ignores, as vLLM ignores what it cannot honour; none is
# a key a typed field sets.
EXTRA_MEMBERS = {
    "n": st.integers(1, 4),
    "logprobs": st.booleans(),
    "response_format": st.just({"type": "json_object"}),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "guided_json": st.just({"type": "object"}),
    "min_p": st.floats(0, 1),
    "x_unknown": text,
}
# Each is refused by the sidecar: not an object, not JSON, a key twice, a key the sidecar
# writes, a key a typed field also sets (generate_case always sends max_tokens >= 1 here).
BAD_EXTRA_JSON = (
    "[]",
    '"text"',
    "null",
    '{"n": ',
    '{"n": NaN}',
    '{"n": 1, "n": 2}',
    '{"stream": false}',
    '{"stream_options": {"include_usage": false}}',
    '{"max_tokens": 5}',
)


@st.composite
def extra_json(draw: st.DrawFn, kind: str) -> str:
    """extra_json text: valid members, none, or (for bad_extra_json) a refused one."""
    if kind == "bad_extra_json":
        return draw(st.sampled_from(BAD_EXTRA_JSON))
    keys = draw(st.lists(st.sampled_from(sorted(EXTRA_MEMBERS)), unique=True, max_size=3))
    if not keys:
        return draw(st.sampled_from(("", "{}", " { } ")))
    return json.dumps({key: draw(EXTRA_MEMBERS[key]) for key in keys})


GENERATE_KINDS = {
    "valid": OK,
    "zero_max_tokens": OK,  # 0 means the pod's default
    "unknown_prefix": NOT_FOUND,
    "huge_max_tokens": INVALID,  # the pod refuses it (context length); its 4xx is relayed
    "unknown_model": INVALID,  # the pod answers 404
    "bad_temperature": INVALID,
    "bad_top_p": INVALID,
    "bad_stop": INVALID,
    "bad_extra_json": INVALID,
}


@st.composite
def generate_case(draw: st.DrawFn, rpc: str, known: Known) -> Case:
    """A Complete or Chat request of one input class that reaches the sidecar's checks
    (and, for OK and pod-refused classes, the pod)."""
    kind = draw(st.sampled_from(["valid"] * 5 + sorted(GENERATE_KINDS)))
    kw = draw(unknown_ref if kind == "unknown_prefix" else ref(known, inline=True))
    has_prefix = any(kw.values())
    if rpc == "Complete":
        kw["input"] = draw(text if has_prefix else nonempty)
    else:
        turns = draw(st.lists(st.tuples(st.sampled_from(CHAT_ROLES), text), min_size=1, max_size=3))
        kw["messages"] = [router_pb2.ChatMessage(role=r, content=c) for r, c in turns]
    kw["max_tokens"] = {
        "zero_max_tokens": 0,
        "huge_max_tokens": draw(st.integers(200_000, 2**32 - 1)),
    }.get(kind, draw(st.integers(1, 4)))
    kw["extra_json"] = draw(extra_json(kind))
    kw["raw_events"] = draw(st.booleans())
    kw["model"] = draw(
        nonempty.filter(lambda v: v != MODEL)
        if kind == "unknown_model"
        else st.sampled_from(("", MODEL))
    )
    kw.update(draw(sampling(kind)))
    message = (
        router_pb2.CompleteRequest(**kw) if rpc == "Complete" else router_pb2.ChatRequest(**kw)
    )
    return Case(rpc, kind, message.SerializeToString(), GENERATE_KINDS[kind])


def complete_cases(known: Known, limits: Limits) -> st.SearchStrategy[Case]:
    rpc, m = "Complete", router_pb2.CompleteRequest
    return st.one_of(
        generate_case(rpc, known),
        generate_case(rpc, known),  # twice: half the cases reach the pod
        st.sampled_from((m(max_tokens=1), m(prefix_text="", input=""))).map(
            make(rpc, "empty", INVALID)
        ),
        over(limits.max_input_bytes)
        .map(lambda t: m(input=t))
        .map(make(rpc, "over_max_input", INVALID)),
        over(limits.max_input_bytes)
        .map(lambda t: m(input="hi", extra_json=json.dumps({"x": t})))
        .map(make(rpc, "over_max_input", INVALID)),
        over(limits.max_prefix_bytes)
        .map(lambda t: m(prefix_text=t, input="q"))
        .map(make(rpc, "over_max_prefix", INVALID)),
        bad_field(
            rpc,
            st.just(m(prefix_name=known.names[0], input="hi", max_tokens=1)),
            (1, 2, 3, 4, 5, 9, 11),
        ),
        random_bytes(rpc),
    )


def chat_cases(known: Known, limits: Limits) -> st.SearchStrategy[Case]:
    rpc, m, msg = "Chat", router_pb2.ChatRequest, router_pb2.ChatMessage
    named: dict[str, Any] = {"prefix_name": known.names[0], "max_tokens": 1}
    user = msg(role="user", content="hello")
    half = "y" * (limits.max_input_bytes // 2 + 1)
    return st.one_of(
        generate_case(rpc, known),
        generate_case(rpc, known),  # twice: half the cases reach the pod
        ref(known, inline=True).map(lambda kw: m(**kw)).map(make(rpc, "empty_messages", INVALID)),
        st.tuples(nonempty.filter(lambda r: r not in CHAT_ROLES), text)
        .map(lambda rc: m(**named, messages=[msg(role=rc[0], content=rc[1])]))
        .map(make(rpc, "unknown_role", INVALID)),
        over(limits.max_input_bytes)
        .map(lambda t: m(**named, messages=[msg(role="user", content=t)]))
        .map(make(rpc, "over_max_input", INVALID)),
        st.just(m(**named, messages=[msg(role="user", content=half)] * 3)).map(
            make(rpc, "over_max_input", INVALID)
        ),
        over(limits.max_prefix_bytes)
        .map(lambda t: m(prefix_text=t, messages=[user]))
        .map(make(rpc, "over_max_prefix", INVALID)),
        over(limits.max_input_bytes)
        .map(lambda t: m(**named, messages=[user], extra_json=json.dumps({"x": t})))
        .map(make(rpc, "over_max_input", INVALID)),
        bad_field(rpc, st.just(m(**named, messages=[user])), (1, 2, 3, 5, 9, 11)),
        # Field 4 is the messages list: one message whose role or content is invalid UTF-8.
        st.builds(
            lambda n, b: Case(
                rpc,
                "invalid_utf8",
                m(**named).SerializeToString() + length_delimited(4, length_delimited(n, b)),
                INVALID,
            ),
            st.sampled_from((1, 2)),
            bad_utf8,
        ),
        random_bytes(rpc),
    )


def prewarm_cases(known: Known, limits: Limits) -> st.SearchStrategy[Case]:
    rpc, m = "Prewarm", router_pb2.PrewarmRequest
    return st.one_of(
        st.builds(lambda kw, a: m(**kw, all_backends=a), ref(known, none=False), st.booleans()).map(
            make(rpc, "valid", OK)
        ),
        unknown_ref.map(lambda kw: m(**kw)).map(make(rpc, "unknown_prefix", NOT_FOUND)),
        st.booleans().map(lambda a: m(all_backends=a)).map(make(rpc, "empty", INVALID)),
        bad_field(rpc, st.just(m(prefix_name=known.names[0])), (1, 2)),
        random_bytes(rpc),
    )


def cases(rpc: str, known: Known, limits: Limits) -> st.SearchStrategy[Case]:
    """Every input class of one RPC."""
    if rpc in ("ListPrefixes", "ListBackends"):
        return list_cases(rpc, limits)
    builders = {
        "RegisterPrefix": register_cases,
        "UnregisterPrefix": unregister_cases,
        "Route": route_cases,
        "Complete": complete_cases,
        "Chat": chat_cases,
        "Prewarm": prewarm_cases,
    }
    return builders[rpc](known, limits)
