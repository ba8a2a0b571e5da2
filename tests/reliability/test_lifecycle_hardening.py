"""Issue 11, lifecycle items: socket ownership across an overlapping restart (3), socket
directories under umask 000 (7), callers that cancel (8), a backends file that is not a
file (10) and member addresses that cannot be pods (13).

Each sidecar here is a real `prefix-sidecar serve` process on a unix socket (or, for the
membership warnings, the real Sidecar in this process so caplog sees them). Pods are
emulator processes or small aiohttp servers on 127.0.0.1; DNS is a dnslib server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from aiohttp import web

from prefix_sidecar.v1 import router_pb2_grpc
from prefix_sidecar_tools.emulator import EmulatorFleet
from prefix_sidecar_tools.harness import (
    SidecarProcess,
    child_env,
    free_port,
    python_command,
    spawn_blocking,
)
from tests.fake_pod import event, recording_pod
from tests.reliability.helpers_b import (
    FAULT_PODS,
    DnsServer,
    SwitchableResolver,
    backend_states,
    fault_config,
    query,
    running_sidecar,
    short_tmpdir,
    wait_logged,
    wait_state,
)

REPO = Path(__file__).resolve().parents[2]


def serve(socket_path: str, args: list[str], log_path: str) -> SidecarProcess:
    """A `prefix-sidecar serve` process with no PREFIX_SIDECAR_* from the test runner."""
    return SidecarProcess(socket_path, args, log_path=log_path, env=child_env(clean=True))


async def health_serving(target: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.02)


def accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


# --- 3: an overlapping restart ---------------------------------------------------------------


async def test_overlapping_restart_keeps_the_new_sidecars_socket() -> None:
    """The old sidecar drains a stream under SIGTERM while the new one binds the path; when
    the old one exits it must leave the new one's socket alone."""
    async with EmulatorFleet(1, FAULT_PODS) as fleet:
        with short_tmpdir() as directory:
            path = str(directory / "s.sock")
            args = ["--backend", fleet.urls[0], "--set", "grace_s=5"]
            old = serve(path, args, log_path=str(directory / "old.log"))
            new = serve(path, args, log_path=str(directory / "new.log"))
            await old.start()
            try:
                async with grpc.aio.insecure_channel(old.target) as channel:
                    stub = router_pb2_grpc.RouterStub(channel)
                    # ~1 s of tokens at 20x: the old sidecar is still draining it when the
                    # new one starts.
                    stream = stub.Complete(query("", "a long answer", max_tokens=700), timeout=30)
                    await stream.read()
                    old.send_signal(signal.SIGTERM)
                    await wait_for(lambda: not accepts(path), 5, "the old sidecar stops accepting")
                    await new.start()
                    new_inode = os.lstat(path).st_ino
                    while await stream.read() != grpc.aio.EOF:
                        pass
                    assert old.process is not None
                    assert await asyncio.wait_for(old.process.wait(), 10) == 0, old.log_text()
                assert os.path.exists(path), "the old sidecar deleted the new sidecar's socket"
                assert os.lstat(path).st_ino == new_inode
                assert await health_serving(new.target)
            finally:
                await old.stop(grace=5)
                await new.stop(grace=5)
            assert not os.path.exists(path), "the new sidecar did not remove its own socket"


# --- 7: socket directories ---------------------------------------------------------------


def run_serve(args: list[str], umask: int | None = None) -> subprocess.Popen[str]:
    """A `serve` expected to fail or be inspected by hand: its output comes back as text."""
    argv = python_command("-m", "prefix_sidecar.cli", "serve", *args)
    if umask is not None:  # set by a shell, not a preexec_fn (see prefix_sidecar_tools/harness.py)
        argv = ["/bin/sh", "-c", f'umask {umask:03o} && exec "$@"', "sh", *argv]
    return spawn_blocking(
        argv, env=child_env(clean=True), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


async def test_socket_directories_are_0750_under_umask_000() -> None:
    with short_tmpdir() as directory:
        socket_path = directory / "a" / "b" / "c" / "s.sock"
        process = run_serve(
            ["--listen", f"unix://{socket_path}", "--backend", "http://127.0.0.1:9"], umask=0
        )
        try:
            await wait_for(lambda: socket_path.exists() or process.poll() is not None, 20, "bind")
            assert process.poll() is None, process.communicate()
            for level in ("a", "a/b", "a/b/c"):
                mode = stat.S_IMODE(os.stat(directory / level).st_mode)
                assert mode == 0o750, f"{level} was created {mode:04o}"
            assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o660
        finally:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=20)


@pytest.mark.parametrize("where", ["socket_directory", "parent"])
def test_a_world_writable_socket_directory_is_refused(where: str) -> None:
    with short_tmpdir() as directory:
        open_dir = directory / "open"
        open_dir.mkdir()
        os.chmod(open_dir, 0o777)
        socket_path = open_dir / "s.sock" if where == "socket_directory" else open_dir / "d/s.sock"
        process = run_serve(
            ["--listen", f"unix://{socket_path}", "--backend", "http://127.0.0.1:9"]
        )
        try:
            _, stderr = process.communicate(timeout=10)
        finally:
            process.kill()  # a sidecar that started anyway (the bug) must not outlive the test
        assert process.returncode == 2, stderr
        assert str(open_dir) in stderr and "world-writable without the sticky bit" in stderr
        assert f"chmod o-w {open_dir}" in stderr
        assert not socket_path.exists()
        # /tmp-style: world-writable with the sticky bit is fine.
        os.chmod(open_dir, 0o1777)
        process = run_serve(
            ["--listen", f"unix://{socket_path}", "--backend", "http://127.0.0.1:9"]
        )
        try:
            deadline = time.monotonic() + 20
            while not socket_path.exists() and process.poll() is None:
                assert time.monotonic() < deadline, "no socket"
                time.sleep(0.05)
            assert process.poll() is None, process.communicate()
        finally:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=20)


# --- 8: callers that cancel --------------------------------------------------------------


async def hold(request: web.Request) -> web.StreamResponse:
    """A pod that keeps every request open for longer than any test here."""
    await asyncio.sleep(60)
    return web.Response(status=503)


async def stream_without_end(request: web.Request) -> web.StreamResponse:
    """A pod streaming 16 KB SSE events without end (~320 MB at most)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    frame = event({"choices": [{"index": 0, "text": "x" * 16_000, "finish_reason": None}]})
    with contextlib.suppress(ConnectionError):
        for _ in range(20_000):
            await response.write(frame)
    return response


def request_statuses(log: str) -> list[str]:
    return re.findall(r"^.* sidecar\.requests Complete .* status=(\S+)", log, re.MULTILINE)


async def test_cancelled_calls_are_labelled_cancelled_without_a_traceback() -> None:
    port = free_port()
    async with recording_pod(stream_without_end) as pod:
        with short_tmpdir() as directory:
            sidecar = serve(
                str(directory / "s.sock"),
                ["--backend", pod.url, "--metrics-port", str(port)],
                log_path=str(directory / "log"),
            )
            async with sidecar, grpc.aio.insecure_channel(sidecar.target) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                for number in range(3):
                    # The caller stops reading: the sidecar's write waits on flow control,
                    # then the caller cancels.
                    call = stub.Complete(query("", f"cancel me {number}", max_tokens=10**6))
                    await call.read()
                    await asyncio.sleep(0.8)
                    call.cancel()
                call = stub.Complete(query("", "deadline", max_tokens=10**6), timeout=1.0)
                await call.read()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.sleep(1.5)
                    while await call.read() != grpc.aio.EOF:
                        pass
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await wait_for(
                    lambda: len(request_statuses(sidecar.log_text())) == 4, 5, "4 request lines"
                )
                metrics = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
                )
            log = sidecar.log_text()
    assert request_statuses(log) == ["CANCELLED"] * 3 + ["DEADLINE_EXCEEDED"], log[-3000:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    text = metrics.decode()
    counted = re.findall(r"^prefix_sidecar_requests_total\{(.*)\} (\S+)$", text, re.MULTILINE)
    by_status: dict[str, float] = {}
    for labels, value in counted:
        status = re.search(r'status="([^"]+)"', labels)
        assert status is not None
        by_status[status.group(1)] = by_status.get(status.group(1), 0) + float(value)
    assert by_status == {"CANCELLED": 3.0, "DEADLINE_EXCEEDED": 1.0}, counted


async def test_queued_callers_that_cancel_are_not_sent_to_the_pod() -> None:
    """800 callers, 100 connections to a pod that never answers: 700 wait for a connection.
    All cancel; the pod must not receive their requests afterwards (before the fix, ~300 of
    them reached it as the first cancels freed connections)."""
    callers, connections = 800, 100
    async with recording_pod(hold) as pod:
        with short_tmpdir() as directory:
            sidecar = serve(
                str(directory / "s.sock"),
                ["--backend", pod.url, "--set", f"per_backend_connections={connections}"],
                log_path=str(directory / "log"),
            )
            async with sidecar, grpc.aio.insecure_channel(sidecar.target) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                calls = [stub.Complete(query("", f"q{n}", max_tokens=4)) for n in range(callers)]

                async def drive(call: grpc.aio.UnaryStreamCall) -> None:
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                        async for _ in call:
                            pass

                tasks = [asyncio.create_task(drive(call)) for call in calls]
                await wait_for(lambda: len(pod.arrived) >= connections, 20, "pod saturated")
                await asyncio.sleep(1.0)  # every caller is queued in the sidecar by now
                assert len(pod.arrived) == connections
                cancelled_at = time.monotonic()
                for call in calls:
                    call.cancel()
                await asyncio.gather(*tasks)
                await wait_for(
                    lambda: len(request_statuses(sidecar.log_text())) == callers,
                    20,
                    f"every call logged ({len(request_statuses(sidecar.log_text()))})",
                )
                await asyncio.sleep(0.5)
            late = sum(1 for at in pod.arrived if at > cancelled_at)
            statuses = request_statuses(sidecar.log_text())
    print(f"\n{callers - connections} queued callers cancelled; {late} reached the pod after")
    assert late <= (callers - connections) // 20, f"{late} cancelled requests reached the pod"
    assert set(statuses) == {"CANCELLED"}, sorted(set(statuses))


# --- 10: a backends file that is not a file ------------------------------------------------


def replace_with(path: Path, make: Callable[[Path], object]) -> None:
    """Swap what is at `path` in one rename, as a ConfigMap update does."""
    temporary = path.with_name(path.name + ".new")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    make(temporary)
    os.replace(temporary, path)


def good_file(url: str) -> Callable[[Path], object]:
    return lambda p: p.write_text(f"- {url}\n", encoding="utf-8")


KEPT = "keeping the last good membership"


def logged_more(sidecar: SidecarProcess, before: int) -> bool:
    return sidecar.log_text().count(KEPT) > before


BAD_FILES: dict[str, Callable[[Path], object]] = {
    "fifo": lambda p: os.mkfifo(p),
    "dev_zero": lambda p: p.symlink_to("/dev/zero"),
    "huge": lambda p: p.write_bytes(b"# " + b"x" * (2 * 1024 * 1024) + b"\n"),
}


async def test_backends_file_that_is_not_a_file_keeps_last_good_and_sigterm_ends() -> None:
    grace_s = 1.0
    async with EmulatorFleet(2, FAULT_PODS) as fleet:
        with short_tmpdir() as directory:
            backends = directory / "backends.yaml"
            replace_with(backends, good_file(fleet.urls[0]))
            args = [
                "--backends-file",
                str(backends),
                "--set",
                "file_interval_s=0.1",
                "--set",
                f"grace_s={grace_s}",
            ]
            sidecar = serve(str(directory / "s.sock"), args, log_path=str(directory / "log"))
            async with sidecar, grpc.aio.insecure_channel(sidecar.target) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                await wait_state(stub, fleet.urls[0], "serving")
                for name, make in BAD_FILES.items():
                    errors = sidecar.log_text().count(KEPT)
                    replace_with(backends, make)
                    await wait_for(
                        functools.partial(logged_more, sidecar, errors),
                        5,
                        f"an error logged for the {name} backends file",
                    )
                    assert await backend_states(stub) == {fleet.urls[0]: "serving"}, name
                # The watcher is still alive: a good file written later is adopted.
                replace_with(backends, good_file(fleet.urls[1]))
                await wait_state(stub, fleet.urls[1], "serving")
                await wait_state(stub, fleet.urls[0], "absent")
                # A FIFO in place when SIGTERM comes: the process still ends in time.
                replace_with(backends, BAD_FILES["fifo"])
                await asyncio.sleep(0.3)
                assert sidecar.process is not None
                signalled = time.monotonic()
                sidecar.send_signal(signal.SIGTERM)
                code = await asyncio.wait_for(sidecar.process.wait(), grace_s + 10)
                took = time.monotonic() - signalled
            log = sidecar.log_text()
    assert took < grace_s + 5, f"SIGTERM took {took:.1f} s"
    assert code == 0, log[-2000:]
    for reason in ("a FIFO, not a regular file", "a character device, not a regular file"):
        assert reason in log, log[-3000:]
    assert "2097155 bytes, over the 1048576-byte limit" in log, log[-3000:]


def test_shutdown_deadline_ends_a_stuck_process() -> None:
    """The last resort behind SIGTERM: whatever hangs, the process is gone by the deadline."""
    code = (
        "import logging, time\n"
        "logging.basicConfig()\n"
        "from prefix_sidecar.server.app import _exit_deadline\n"
        "_exit_deadline(0.5)\n"
        "time.sleep(30)\n"
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert time.monotonic() - started < 10
    assert result.returncode == 1
    assert "shutdown did not finish within 0.5 s" in result.stderr


# --- 13: member addresses that cannot be pods ------------------------------------------------


SPECIAL_IPS = ["0.0.0.0", "169.254.169.254", "169.254.1.1", "224.0.0.1", "255.255.255.255"]


@pytest.fixture
async def health_pod() -> AsyncIterator[str]:
    async with recording_pod(hold) as pod:
        yield pod.url


async def test_dns_records_at_special_addresses_are_refused(
    health_pod: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    port = int(health_pod.rsplit(":", 1)[1])
    resolver = SwitchableResolver("vllm.test", ["127.0.0.1", *SPECIAL_IPS])
    with DnsServer(resolver) as dns, short_tmpdir() as directory:
        async with running_sidecar(dns.sidecar_config(directory, port)) as client:
            await wait_state(client.stub, health_pod, "serving")
            await dns.wait_queries(4)  # two more polls: each refused record is warned once
            assert set(await backend_states(client.stub)) == {health_pod}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for ip in SPECIAL_IPS:
        named = [w for w in warnings if f"A record {ip} of vllm.test" in w]
        assert len(named) == 1, (ip, warnings)
        assert f"DNS vllm.test:{port}" in named[0]
        assert "allow_special_backend_addresses" in named[0]


@pytest.mark.parametrize("allow", [False, True])
async def test_file_members_at_special_addresses_are_refused_unless_allowed(
    health_pod: str, allow: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    port = int(health_pod.rsplit(":", 1)[1])
    special = [
        f"http://0.0.0.0:{port}",
        f"http://[::]:{port}",
        "http://169.254.169.254:80",
        "http://[fe80::1]:8000",
        "http://[ff02::1]:8000",
        "http://239.1.2.3:8000",
        "http://255.255.255.255:8000",
    ]
    with short_tmpdir() as directory:
        backends = directory / "backends.yaml"
        backends.write_text("".join(f"- '{url}'\n" for url in [health_pod, *special]))
        config = fault_config(
            directory, backends_file=str(backends), allow_special_backend_addresses=allow
        )
        async with running_sidecar(config) as client:
            await wait_state(client.stub, health_pod, "serving")
            members = set(await backend_states(client.stub))
            if not allow:
                await wait_logged(caplog, "refusing backend http://[fe80::1]:8000")
    if allow:
        assert members == {health_pod, *special}
        return
    assert members == {health_pod}
    warnings = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    for url in special:
        assert any(f"refusing backend {url}:" in w and str(backends) in w for w in warnings), url
