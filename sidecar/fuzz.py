"""Fuzz every sidecar.v1.Router RPC with hypothesis: each case must get its documented status.

A case is one request already encoded as raw protobuf bytes, so invalid UTF-8 and random
bytes reach the server exactly as a broken client would send them, plus the statuses that
docs/RELIABILITY.md allows for its RPC and input class. A case passes when its status is in
that set, an error carries a message, and the call ends before its deadline (no hang); every
`probe_every` cases a known-good request must still succeed. The pytest suite and
`prefix-sidecar fuzz --cases N` share these generators, the target and the runner.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from sidecar.v1 import router_pb2

SERVICE = "/sidecar.v1.Router/"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # the dir holding `sidecar/`
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
    of the main mix because grpc takes ~0.15 s to refuse each one."""
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


GENERATE_KINDS = {
    "valid": OK,
    "zero_max_tokens": OK,  # 0 means the pod's default
    "unknown_prefix": NOT_FOUND,
    "huge_max_tokens": INVALID,  # the pod refuses it (context length); its 4xx is relayed
    "unknown_model": INVALID,  # the pod answers 404
    "bad_temperature": INVALID,
    "bad_top_p": INVALID,
    "bad_stop": INVALID,
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
        over(limits.max_prefix_bytes)
        .map(lambda t: m(prefix_text=t, input="q"))
        .map(make(rpc, "over_max_prefix", INVALID)),
        bad_field(
            rpc,
            st.just(m(prefix_name=known.names[0], input="hi", max_tokens=1)),
            (1, 2, 3, 4, 5, 9),
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
        bad_field(rpc, st.just(m(**named, messages=[user])), (1, 2, 3, 5, 9)),
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


# --- the target: one emulator pod and one sidecar ------------------------------------------


class FuzzTarget:
    """An emulator pod and a sidecar, each a real `prefix-sidecar` process on 127.0.0.1, dialed
    through a blocking channel: hypothesis drives plain functions, a crash shows as a dead
    process, and the sidecar's stderr (its INFO log) is kept in `log_path` for inspection."""

    def __init__(self, limits: Limits = Limits(), time_scale: float = 10_000.0) -> None:
        self.limits = limits
        self.time_scale = time_scale
        self.url = ""
        self.known = Known((), ())
        self._dir = tempfile.TemporaryDirectory(prefix="psfuzz-")
        self.target = f"unix://{self._dir.name}/sidecar.sock"
        self.log_path = Path(self._dir.name) / "sidecar.log"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.channel: grpc.Channel | None = None

    def __enter__(self) -> FuzzTarget:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (PACKAGE_ROOT, env.get("PYTHONPATH"))))
        pod = subprocess.Popen(
            [sys.executable, "-m", "sidecar.emulator", "--port", "0", "--exit-on-stdin-eof",
             "--model", MODEL, "--time-scale", str(self.time_scale)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )  # fmt: skip
        self.processes.append(pod)
        assert pod.stdout is not None
        line = pod.stdout.readline().decode().split()
        if len(line) != 2 or line[0] != "READY":
            raise RuntimeError(f"the emulator did not start (said {line!r})")
        self.url = line[1]
        settings_ = {
            "health_interval_s": 0.5,
            "first_token_timeout_s": 5,
            "prewarm_backoff_s": 0.05,
            "grace_s": 1,
            "max_prefixes": 100_000,
            "max_prefix_bytes": self.limits.max_prefix_bytes,
            "max_input_bytes": self.limits.max_input_bytes,
            "max_message_bytes": self.limits.max_message_bytes,
        }
        argv = [sys.executable, "-m", "sidecar.cli", "serve", "--listen", self.target,
                "--backend", self.url]  # fmt: skip
        for name, value in settings_.items():
            argv += ["--set", f"{name}={value}"]
        with open(self.log_path, "wb") as log:
            self.processes.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env))
        self.channel = grpc.insecure_channel(
            self.target, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
        try:
            grpc.channel_ready_future(self.channel).result(timeout=20)
        except grpc.FutureTimeoutError:
            raise RuntimeError(f"the sidecar did not start: {self.log_path.read_text()}") from None
        self._wait_serving()
        self.known = self._register_known()

    def __exit__(self, *exc: object) -> None:
        if self.channel is not None:
            self.channel.close()
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdin is not None:
                process.stdin.close()
            if process.stdout is not None:
                process.stdout.close()
        self.processes.clear()

    def cleanup(self) -> None:
        self._dir.cleanup()

    def alive(self) -> bool:
        return bool(self.processes) and all(p.poll() is None for p in self.processes)

    def unary(self, rpc: str, request: Any, timeout: float = 10.0) -> Any:
        assert self.channel is not None
        call = self.channel.unary_unary(
            SERVICE + rpc,
            request_serializer=type(request).SerializeToString,
            response_deserializer=RESPONSES[rpc].FromString,
        )
        return call(request, timeout=timeout)

    def stream(self, rpc: str, request: Any, timeout: float = 10.0) -> list[Any]:
        assert self.channel is not None
        call = self.channel.unary_stream(
            SERVICE + rpc,
            request_serializer=type(request).SerializeToString,
            response_deserializer=RESPONSES[rpc].FromString,
        )
        return list(call(request, timeout=timeout))

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            reply = self.unary("ListBackends", router_pb2.ListBackendsRequest())
            if [b.state for b in reply.backends] == ["serving"]:
                return
            time.sleep(0.05)
        raise RuntimeError("the emulator pod never became serving")

    def _register_known(self) -> Known:
        texts = {
            "known-rules": "You are a careful compliance assistant. Rule: cite sources. " * 40,
            "known-short": "Be brief. ",
        }
        ids = [
            self.unary("RegisterPrefix", router_pb2.RegisterPrefixRequest(name=n, text=t)).id
            for n, t in texts.items()
        ]
        return Known(tuple(ids), tuple(texts))

    def probe(self) -> None:
        """A known-good Route and Complete must still work; scratch prefixes are dropped so
        the store stays small however long the fuzz runs."""
        name = self.known.names[0]
        route = self.unary("Route", router_pb2.RouteRequest(prefix_name=name))
        assert route.backend == self.url, f"probe Route answered {route}"
        request = router_pb2.CompleteRequest(prefix_name=name, input="ping", max_tokens=2)
        chunks = self.stream("Complete", request)
        assert chunks and chunks[0].backend == self.url, f"probe Complete answered {chunks}"
        assert chunks[-1].usage.completion_tokens >= 1, f"probe Complete usage {chunks[-1]}"
        for prefix in self.unary("ListPrefixes", router_pb2.ListPrefixesRequest()).prefixes:
            if prefix.id not in self.known.ids:
                with contextlib.suppress(grpc.RpcError):  # a name may cover several ids
                    self.unary(
                        "UnregisterPrefix", router_pb2.UnregisterPrefixRequest(prefix_id=prefix.id)
                    )


# --- running cases ---------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str
    message: str
    replies: list[bytes]


def execute(channel: grpc.Channel, case: Case, timeout: float) -> Outcome:
    """Send raw bytes (identity serializers) and collect the status; never raises RpcError."""
    try:
        if case.rpc in STREAMING:
            replies = list(channel.unary_stream(SERVICE + case.rpc)(case.payload, timeout=timeout))
        else:
            replies = [channel.unary_unary(SERVICE + case.rpc)(case.payload, timeout=timeout)]
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "", [])
    return Outcome("OK", "", replies)


def problems(case: Case, outcome: Outcome, url: str) -> list[str]:
    """What is wrong with this answer to this case (empty: documented behaviour)."""
    found = []
    if outcome.status not in case.allowed:
        found.append(f"status {outcome.status} ({outcome.message!r}) not in {sorted(case.allowed)}")
    if outcome.status != "OK" and not outcome.message.strip():
        found.append(f"status {outcome.status} without a message")
    if outcome.status == "OK":
        replies = [RESPONSES[case.rpc].FromString(r) for r in outcome.replies]
        if case.rpc in ("Complete", "Chat") and not (replies and replies[0].backend == url):
            found.append(f"OK stream without a first chunk naming the backend: {replies[:2]}")
        if case.rpc == "Route" and replies[0].backend != url:
            found.append(f"OK Route without the backend: {replies[0]}")
        if case.rpc == "Prewarm" and not replies:
            found.append("OK Prewarm without events")
    return found


@dataclass
class Fuzzer:
    """Runs cases against a target, tallies statuses, probes health every `probe_every`."""

    target: FuzzTarget
    timeout_s: float = 10.0
    probe_every: int = 200
    counts: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    # (rpc, input class) -> the statuses allowed for it, for every class that ran.
    classes: dict[tuple[str, str], frozenset[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    cases_run: int = 0

    def check(self, case: Case) -> None:
        assert self.target.channel is not None
        started = time.monotonic()
        outcome = execute(self.target.channel, case, self.timeout_s)
        elapsed = time.monotonic() - started
        self.cases_run += 1
        self.counts[(case.rpc, outcome.status)] += 1
        self.classes[(case.rpc, case.kind)] = case.allowed
        found = problems(case, outcome, self.target.url)
        if outcome.status == "DEADLINE_EXCEEDED":
            found.append(f"hang: no answer within {self.timeout_s} s ({elapsed:.1f} s)")
        if self.cases_run % self.probe_every == 0:
            found += self.health()
        if found:
            raise AssertionError(f"{case!r}: " + "; ".join(found))

    def health(self) -> list[str]:
        if not self.target.alive():
            return [f"a process died: {[p.returncode for p in self.target.processes]}"]
        try:
            self.target.probe()
        except (AssertionError, grpc.RpcError) as exc:
            return [f"the sidecar no longer serves a good request: {exc}"]
        return []

    def run(
        self,
        rpc: str,
        examples: int,
        seed: int | None = None,
        strategy: st.SearchStrategy[Case] | None = None,
    ) -> None:
        """`examples` hypothesis cases of one RPC (all its input classes unless `strategy`
        is given); raises AssertionError with the shrunk failing case."""
        if strategy is None:
            strategy = cases(rpc, self.target.known, self.target.limits)

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.generate, Phase.shrink),
        )
        @given(strategy)
        def fuzz_one(case: Case) -> None:
            self.check(case)

        if seed is not None:
            fuzz_one = hypothesis_seed(seed)(fuzz_one)
        fuzz_one()


# --- `prefix-sidecar fuzz` -------------------------------------------------------------------

# Share of the cases per RPC: cheap refusals dominate, streaming calls get enough to cover
# every input class. The CI suite uses the same shares for its 10,000 cases.
SHARES = {
    "Route": 0.24,
    "RegisterPrefix": 0.14,
    "UnregisterPrefix": 0.07,
    "ListPrefixes": 0.03,
    "ListBackends": 0.03,
    "Complete": 0.21,
    "Chat": 0.21,
    "Prewarm": 0.07,
}
BATCH = 2000  # hypothesis keeps per-run state: long runs are split into seeded batches


def split(total: int, rpcs: tuple[str, ...] = RPCS) -> dict[str, int]:
    """Cases per RPC for `total` cases (at least one each)."""
    weight = sum(SHARES[r] for r in rpcs)
    return {r: max(1, round(total * SHARES[r] / weight)) for r in rpcs}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fuzz",
        help="fuzz every RPC of a fresh sidecar with hypothesis",
        description="Start an emulator pod and a sidecar, send N generated requests (random "
        "and malformed fields, huge strings, invalid UTF-8, random bytes...), and check each "
        "gets its documented status (docs/RELIABILITY.md). Exits 1 on any undocumented "
        "status, hang or crash.",
    )
    parser.add_argument("--cases", type=int, default=10_000, help="number of cases (10000)")
    parser.add_argument("--seed", type=int, help="hypothesis seed, for a reproducible run")
    parser.add_argument("--rpc", action="append", choices=RPCS, help="only these RPCs")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-call deadline, s (10)")
    parser.add_argument("--probe-every", type=int, default=200, help="good request every N")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.cases < 1 or args.timeout <= 0 or args.probe_every < 1:
        print(
            "prefix-sidecar fuzz: --cases, --timeout and --probe-every must be > 0", file=sys.stderr
        )
        return 2
    rpcs = tuple(args.rpc or RPCS)
    plan = split(args.cases, rpcs)
    started = time.monotonic()
    target = FuzzTarget()
    with target:
        fuzzer = Fuzzer(target, timeout_s=args.timeout, probe_every=args.probe_every)
        for rpc, total in plan.items():
            oversize = max(1, total // 200)  # slow to refuse (see over_max_message)
            for batch, start in enumerate(range(0, total, BATCH)):
                seed = None if args.seed is None else args.seed * 1000 + batch
                try:
                    fuzzer.run(rpc, min(BATCH, total - start), seed=seed)
                    if batch == 0:
                        fuzzer.run(
                            rpc, oversize, seed=seed, strategy=over_max_message(rpc, target.limits)
                        )
                except Exception as exc:
                    # hypothesis raises an ExceptionGroup when it found several distinct bugs
                    found = exc.exceptions if isinstance(exc, ExceptionGroup) else [exc]
                    fuzzer.failures += [f"{rpc}: {error}" for error in found]
                    break
            print(
                f"{rpc}: done ({sum(n for (r, _), n in fuzzer.counts.items() if r == rpc)} cases)",
                file=sys.stderr,
            )
        fuzzer.failures += [f"final check: {p}" for p in fuzzer.health()]
    target.cleanup()
    print(table(fuzzer.counts))
    elapsed = time.monotonic() - started
    print(f"{fuzzer.cases_run} cases in {elapsed:.1f} s, {len(fuzzer.failures)} failure(s)")
    for failure in fuzzer.failures:
        print(f"FAIL {failure}")
    return 1 if fuzzer.failures else 0


def table(counts: collections.Counter[tuple[str, str]]) -> str:
    """Statuses per RPC as a fixed-width table."""
    statuses = sorted({s for _, s in counts}, key=lambda s: (s != "OK", s))
    rows = [["RPC", *statuses, "total"]]
    for rpc in RPCS:
        row = [counts[(rpc, s)] for s in statuses]
        if any(row):
            rows.append([rpc, *map(str, row), str(sum(row))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
