"""Security: the local socket's permissions, the TCP listener's TLS and mTLS, the upstream API
key's secrecy, request size limits, and no prompt text in logs above DEBUG. One test (or a
few) per point of issue 7; certificates are made by the tests (conftest `certs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web

from prefix_sidecar.config import ConfigError, build_config
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.harness import child_env, free_port
from tests.api_key import KeySettings
from tests.cli import run_cli, start_cli
from tests.fake_pod import Handler, StartPod

StartSidecar = Callable[..., contextlib.AbstractAsyncContextManager[Any]]


# --- the unix socket -------------------------------------------------------------------------


async def test_socket_is_0660_by_default(fake_pod: StartPod, start_sidecar: StartSidecar) -> None:
    pod = await fake_pod()
    async with start_sidecar([pod.url]) as (sidecar, stub):
        assert sidecar.config.socket_mode == 0o660
        info = os.stat(sidecar.socket_path)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o660
        await stub.ListBackends(router_pb2.ListBackendsRequest())


def other_group() -> str:
    """A group other than ours, when we may chown to it (root); else our primary group."""
    if os.geteuid() == 0:
        for group in grp.getgrall():
            if group.gr_gid != os.getgid():
                return group.gr_name
    return grp.getgrgid(os.getgid()).gr_name


@pytest.mark.parametrize("which", ["primary", "other"])
async def test_socket_group_and_mode_are_configurable(
    which: str, fake_pod: StartPod, start_sidecar: StartSidecar
) -> None:
    group = grp.getgrgid(os.getgid()).gr_name if which == "primary" else other_group()
    pod = await fake_pod()
    async with start_sidecar([pod.url], socket_group=group, socket_mode="0640") as (sidecar, _):
        info = os.stat(sidecar.socket_path)
        assert info.st_gid == grp.getgrnam(group).gr_gid
        assert stat.S_IMODE(info.st_mode) == 0o640


def test_unknown_socket_group_is_a_clear_start_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'socket_group' names no group on this host"):
        build_config({"listen": f"unix://{tmp_path}/s.sock", "socket_group": "no-such-grp-42"})
    listen, backend = f"unix://{tmp_path}/s.sock", "http://127.0.0.1:1"
    result = run_cli(
        "serve", "--listen", listen, "--backend", backend, "--set", "socket_group=no-such-grp-42"
    )
    assert result.returncode == 2
    assert "socket_group" in result.stderr and "no-such-grp-42" in result.stderr
    assert not (tmp_path / "s.sock").exists()


# --- the TCP listener: off by default, TLS and mTLS when on -----------------------------------


def listening_tcp_ports(pid: int) -> set[int]:
    """TCP ports in LISTEN state owned by sockets open in process `pid` (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def test_tcp_listener_is_off_by_default(fake_pod: StartPod, tmp_path: Path) -> None:
    """A real `serve` process with the default config listens on its unix socket only."""
    pod = await fake_pod()
    sock = tmp_path / "s.sock"
    process = await start_cli(
        "serve", "--listen", f"unix://{sock}", "--backend", pod.url, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 20)
            await router_pb2_grpc.RouterStub(channel).ListBackends(router_pb2.ListBackendsRequest())
        assert listening_tcp_ports(process.pid) == set()
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.communicate(), 20)


def tls_fields(certs: Any, port: int, mtls: bool) -> dict[str, object]:
    fields: dict[str, object] = {
        "tcp_listen": f"127.0.0.1:{port}",
        "tls_cert_file": str(certs.server_cert),
        "tls_key_file": str(certs.server_key),
    }
    if mtls:
        fields["tls_client_ca_file"] = str(certs.ca)
    return fields


async def call_over_tcp(port: int, credentials: grpc.ChannelCredentials | None) -> str:
    """ListBackends over TCP; the status name ("OK" when it worked)."""
    target = f"127.0.0.1:{port}"
    channel = (
        grpc.aio.secure_channel(target, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        try:
            await router_pb2_grpc.RouterStub(channel).ListBackends(
                router_pb2.ListBackendsRequest(), timeout=3
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return "OK"


def read(path: Path) -> bytes:
    return path.read_bytes()


async def test_tls_serves_with_the_ca_and_refuses_plaintext(
    certs: Any, fake_pod: StartPod, start_sidecar: StartSidecar
) -> None:
    pod, port = await fake_pod(), free_port()
    async with start_sidecar([pod.url], **tls_fields(certs, port, mtls=False)) as (sidecar, _):
        assert sidecar.tcp_port == port
        trusted = grpc.ssl_channel_credentials(root_certificates=read(certs.ca))
        assert await call_over_tcp(port, trusted) == "OK"
        assert await call_over_tcp(port, None) == "UNAVAILABLE"  # plaintext
        wrong_ca = grpc.ssl_channel_credentials(root_certificates=read(certs.other_ca))
        assert await call_over_tcp(port, wrong_ca) == "UNAVAILABLE"


async def test_mtls_needs_a_client_cert_from_the_client_ca(
    certs: Any, fake_pod: StartPod, start_sidecar: StartSidecar
) -> None:
    pod, port = await fake_pod(), free_port()
    async with start_sidecar([pod.url], **tls_fields(certs, port, mtls=True)):
        ca = read(certs.ca)
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        assert await call_over_tcp(port, no_cert) == "UNAVAILABLE"
        intruder = grpc.ssl_channel_credentials(
            ca, read(certs.other_client_key), read(certs.other_client_cert)
        )
        assert await call_over_tcp(port, intruder) == "UNAVAILABLE"
        client = grpc.ssl_channel_credentials(ca, read(certs.client_key), read(certs.client_cert))
        assert await call_over_tcp(port, client) == "OK"
        assert await call_over_tcp(port, None) == "UNAVAILABLE"


# --- the upstream API key ----------------------------------------------------------------------

SECRET = "sk-test-" + uuid.uuid4().hex


async def echo_key_and_fail(request: web.Request) -> web.Response:
    """A pod that echoes the Authorization header in its error, as careless servers do."""
    auth = request.headers.get("Authorization", "")
    status = 401 if "tell-401" in (await request.text()) else 500
    return web.json_response({"error": {"message": f"bad credentials {auth}"}}, status=status)


async def key_scenario(stub: Any, pod: Any) -> list[str]:
    """A good request, then failing ones; returns the error messages the caller saw."""
    chunks = [c async for c in stub.Complete(router_pb2.CompleteRequest(input="hi"), timeout=10)]
    assert chunks and chunks[0].backend == pod.url
    pod.handler = echo_key_and_fail
    messages = []
    for text in ("tell-401", "tell-500"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in stub.Complete(router_pb2.CompleteRequest(input=text), timeout=10)]
        messages.append(info.value.details() or "")
    return messages


async def test_api_key_is_sent_as_bearer_never_logged_never_echoed(
    key_settings: KeySettings,
    fake_pod: StartPod,
    start_sidecar: StartSidecar,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fields = key_settings(SECRET)
    pod = await fake_pod()
    async with start_sidecar([pod.url], **fields) as (_, stub):
        messages = await key_scenario(stub, pod)
    assert pod.headers[0]["Authorization"] == f"Bearer {SECRET}"
    assert "rejected the request: HTTP 401" in messages[0] and "HTTP 500" in messages[1]
    for message in messages:
        assert SECRET not in message, f"the API key was echoed to the caller: {message}"
        assert "Bearer [redacted]" in message  # the pod did echo it: the check is not vacuous
    assert caplog.records, "nothing was logged: the check below would prove nothing"
    assert SECRET not in caplog.text


async def test_api_key_not_in_serve_stderr_or_printed_config(
    fake_pod: StartPod, tmp_path: Path
) -> None:
    pod = await fake_pod()
    sock = tmp_path / "s.sock"
    env = child_env(PREFIX_SIDECAR_API_KEY=SECRET)
    serve = [
        "serve",
        "--listen",
        f"unix://{sock}",
        "--backend",
        pod.url,
        "--set",
        "log_level=debug",
    ]
    printed = run_cli(*serve, "--print-config", env=env)
    assert printed.returncode == 0 and "api_key_file" in printed.stdout
    assert SECRET not in printed.stdout + printed.stderr
    process = await start_cli(*serve, env=env, stderr=asyncio.subprocess.PIPE)
    try:
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 20)
            messages = await key_scenario(router_pb2_grpc.RouterStub(channel), pod)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 20)
    assert pod.headers[0]["Authorization"] == f"Bearer {SECRET}"
    log = stderr.decode()
    assert "DEBUG" in log and "Complete" in log, log[-2000:]
    assert SECRET not in log
    assert all(SECRET not in m for m in messages)


# --- size limits -------------------------------------------------------------------------------

LIMITS = {"max_message_bytes": 64 * 1024, "max_prefix_bytes": 8 * 1024, "max_input_bytes": 2048}


async def status_of(call: Any) -> str:
    try:
        result = call
        if hasattr(result, "__aiter__"):
            [item async for item in result]
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        assert exc.details(), "an error without a message"
        return exc.code().name
    return "OK"


async def test_size_limits(fake_pod: StartPod, start_sidecar: StartSidecar) -> None:
    pod = await fake_pod()
    async with start_sidecar([pod.url], **LIMITS) as (_, stub):
        big = "x" * (64 * 1024 + 1)
        over_prefix, over_input = "p" * (8 * 1024 + 1), "i" * 2049
        cases = {
            "message over max_message_bytes (Complete)": (
                stub.Complete(router_pb2.CompleteRequest(input=big)), "RESOURCE_EXHAUSTED"),
            "message over max_message_bytes (RegisterPrefix)": (
                stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="a", text=big)),
                "RESOURCE_EXHAUSTED"),
            "prefix over max_prefix_bytes (RegisterPrefix)": (
                stub.RegisterPrefix(router_pb2.RegisterPrefixRequest(name="a", text=over_prefix)),
                "INVALID_ARGUMENT"),
            "prefix over max_prefix_bytes (Complete)": (
                stub.Complete(router_pb2.CompleteRequest(prefix_text=over_prefix, input="q")),
                "INVALID_ARGUMENT"),
            "input over max_input_bytes (Complete)": (
                stub.Complete(router_pb2.CompleteRequest(input=over_input)), "INVALID_ARGUMENT"),
            "message over max_input_bytes (Chat)": (
                stub.Chat(router_pb2.ChatRequest(messages=[
                    router_pb2.ChatMessage(role="user", content=over_input)])),
                "INVALID_ARGUMENT"),
            "multi-byte input just over the byte limit": (
                stub.Complete(router_pb2.CompleteRequest(input="é" * 1025)), "INVALID_ARGUMENT"),
            "input exactly at the limit": (
                stub.Complete(router_pb2.CompleteRequest(input="i" * 2048)), "OK"),
        }  # fmt: skip
        for name, (call, expected) in cases.items():
            assert await status_of(call) == expected, name
    assert len(pod.bodies) == 1, "only the request within the limits may reach the pod"


# --- no prompt text in logs above DEBUG --------------------------------------------------------


def echoing_the_prompt(status: int) -> Handler:
    """A pod whose error repeats the prompt, as some servers' validation errors do."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.text()
        return web.json_response({"error": {"message": f"cannot serve {body}"}}, status=status)

    return echo


def lines_above_debug(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG]


@pytest.fixture
def marker(caplog: pytest.LogCaptureFixture) -> str:
    """A text no other test sends, to look for in the log; everything is logged from DEBUG."""
    caplog.set_level(logging.DEBUG)
    return "MARKER" + uuid.uuid4().hex


async def test_prompt_and_prefix_text_never_logged_above_debug(
    fake_pod: StartPod, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture, marker: str
) -> None:
    pod = await fake_pod()
    async with start_sidecar([pod.url]) as (_, stub):
        prefix = await stub.RegisterPrefix(
            router_pb2.RegisterPrefixRequest(name="rules", text=f"rules {marker} " * 20)
        )
        m = router_pb2
        calls = [
            stub.Route(m.RouteRequest(prompt=f"question {marker}")),
            stub.Route(m.RouteRequest(prompt=f"rules {marker} " * 20 + "tail")),
            stub.Complete(m.CompleteRequest(prefix_id=prefix.id, input=f"input {marker}")),
            stub.Complete(m.CompleteRequest(prefix_text=f"inline {marker}", input="x")),
            stub.Chat(m.ChatRequest(prefix_name="rules",
                                    messages=[m.ChatMessage(role="user", content=marker)])),
            # failing ones
            stub.Complete(m.CompleteRequest(input=marker, temperature=-1)),
            stub.Chat(m.ChatRequest(messages=[m.ChatMessage(role=marker, content=marker)])),
            stub.Complete(m.CompleteRequest(prefix_name=marker, input=marker)),
            stub.RegisterPrefix(m.RegisterPrefixRequest(name="x" * 300, text=marker)),
        ]  # fmt: skip
        statuses = [await status_of(call) for call in calls]
        assert statuses[:5] == ["OK"] * 5 and "OK" not in statuses[5:], statuses
        pod.handler = echoing_the_prompt(503)
        assert await status_of(stub.Complete(m.CompleteRequest(input=marker))) == "UNAVAILABLE"
    above_debug = lines_above_debug(caplog)
    assert any("Complete" in line for line in above_debug), "request lines must be logged"
    leaks = [line for line in above_debug if marker in line]
    assert not leaks, f"prompt text logged above DEBUG: {leaks}"


async def test_prefix_text_not_logged_when_a_prewarm_fails(
    fake_pod: StartPod, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture, marker: str
) -> None:
    pod = await fake_pod()
    async with start_sidecar([pod.url]) as (_, stub):
        pod.handler = echoing_the_prompt(400)
        request = router_pb2.RegisterPrefixRequest(name="rules", text=marker, prewarm=True)
        reply = await stub.RegisterPrefix(request)
        assert reply.prewarm and reply.prewarm[-1].state == router_pb2.PrewarmEvent.FAILED
    above_debug = lines_above_debug(caplog)
    assert not [line for line in above_debug if marker in line], above_debug
