"""The unix socket (mode, stale and live files) and the standard gRPC services."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import socket
import stat
import subprocess
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.server.common.unix_socket import SocketFile, SocketInUse
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import run_emulator
from tests.server.conftest import (
    FAST,
    free_port,
    health_status,
    running_sidecar,
    sidecar_config,
    socket_path,
)


def mode_of(path: str) -> int:
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    return stat.S_IMODE(st.st_mode)


async def test_socket_is_0660_by_default(sidecar: Sidecar) -> None:
    assert mode_of(sidecar.socket_path) == 0o660


async def test_socket_mode_is_configurable_and_the_socket_is_removed_on_stop(
    tmp_path: Path, pods: list[str]
) -> None:
    config = sidecar_config(tmp_path, pods, socket_mode="0600")
    async with running_sidecar(config) as (sidecar, _):
        assert mode_of(sidecar.socket_path) == 0o600
    assert not os.path.exists(config.socket_path)


@contextlib.contextmanager
def bound_socket_file(path: str, mode: int) -> Iterator[SocketFile]:
    """A SocketFile bound and secured as a front does it, its listener closed after."""
    socket_file = SocketFile(path, mode, "")
    listener = socket.socket(socket.AF_UNIX)
    try:
        with socket_file.creating():
            listener.bind(path)
            socket_file.bound()
        socket_file.secure()
        yield socket_file
    finally:
        listener.close()


def test_a_file_on_the_same_inode_bound_since_is_not_removed(tmp_path: Path) -> None:
    """grpc unlinks the socket when the old sidecar stops listening, and the filesystem may
    give that inode number to the socket a new sidecar binds next. A hard link puts the same
    inode back at the path with a new change time, as such a reuse would look."""
    path = str(tmp_path / "s.sock")
    with bound_socket_file(path, 0o660) as socket_file:
        keep = str(tmp_path / "kept")
        os.link(path, keep)
        os.unlink(path)
        os.link(keep, path)  # the link count changed: so did the change time
        assert os.lstat(path).st_ino == os.lstat(keep).st_ino
        socket_file.remove()
        assert os.path.exists(path), "removed a file this process did not bind"


def test_the_socket_it_bound_is_removed_after_its_mode_is_set(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with bound_socket_file(path, 0o600) as socket_file:  # chmod moves the change time
        socket_file.remove()
        assert not os.path.exists(path)


async def test_a_stale_socket_file_is_replaced(tmp_path: Path, pods: list[str]) -> None:
    path = socket_path(tmp_path)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # bound, never listening, then closed: what a crashed sidecar leaves
    stale.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    async with running_sidecar(sidecar_config(tmp_path, pods)) as (sidecar, _):
        assert await health_status(sidecar.target) == health_pb2.HealthCheckResponse.SERVING


@contextlib.contextmanager
def no_leak_from_a_refused_start() -> Iterator[None]:
    """Fails if what runs inside leaves a resource open (a ResourceWarning). What earlier
    tests left to the collector is collected first, so that it is not blamed on this one."""
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, f"a sidecar that refused to start left resources open: {leaks}"


async def test_a_live_socket_is_refused_and_left_alone(tmp_path: Path, pods: list[str]) -> None:
    config = sidecar_config(tmp_path, pods)
    async with running_sidecar(config) as (first, _):
        with (
            no_leak_from_a_refused_start(),
            pytest.raises(SocketInUse, match="another process is listening"),
        ):
            await Sidecar(config).start()
        # The first sidecar still owns its socket and still answers on it.
        assert await health_status(first.target) == health_pb2.HealthCheckResponse.SERVING


async def test_a_regular_file_at_the_path_is_refused_not_deleted(
    tmp_path: Path, pods: list[str]
) -> None:
    path = Path(socket_path(tmp_path))
    path.write_text("precious", encoding="utf-8")
    with no_leak_from_a_refused_start(), pytest.raises(SocketInUse, match="is not a socket"):
        await Sidecar(sidecar_config(tmp_path, pods)).start()
    assert path.read_text(encoding="utf-8") == "precious"


@pytest.mark.parametrize("service", ["", "sidecar.v1.Router"])
async def test_health_serving(sidecar: Sidecar, service: str) -> None:
    assert await health_status(sidecar.target, service) == health_pb2.HealthCheckResponse.SERVING


async def test_health_of_an_unknown_service_is_not_found(sidecar: Sidecar) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_status(sidecar.target, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services_and_describes_the_api(tmp_path: Path) -> None:
    """What grpcurl does: list services, then resolve a method's types by reflection only."""
    ready: asyncio.Queue[str] = asyncio.Queue()

    async def serve(stop: asyncio.Event) -> None:
        async with (
            run_emulator(FAST, port=0) as pod,
            running_sidecar(sidecar_config(tmp_path, [pod])) as (sidecar, _),
        ):
            ready.put_nowait(sidecar.target)
            await stop.wait()

    # ProtoReflectionDescriptorDatabase is a blocking client: run the sidecar in a loop on
    # another thread and query it from this one, as an external tool would.
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    targets: list[str] = []

    def run() -> None:
        async def main() -> None:
            task = asyncio.create_task(serve(stop))
            targets.append(await ready.get())
            started.set()
            await task

        loop.run_until_complete(main())

    started = threading.Event()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(10), "sidecar did not start"
        with grpc.insecure_channel(targets[0]) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = set(database.get_services())
            pool = descriptor_pool.DescriptorPool(database)
            router = pool.FindServiceByName("sidecar.v1.Router")
            complete = router.FindMethodByName("Complete")
            chunk_fields = {f.name for f in complete.output_type.fields}
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
    assert {
        "sidecar.v1.Router",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services
    assert complete.server_streaming
    assert complete.input_type.full_name == "sidecar.v1.CompleteRequest"
    assert {"text", "backend", "usage", "finish_reason", "attempts"} <= chunk_fields
    assert {m.name for m in router.methods} >= {
        "RegisterPrefix",
        "UnregisterPrefix",
        "ListPrefixes",
        "Route",
        "Complete",
        "Chat",
        "Prewarm",
        "ListBackends",
    }


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A localhost certificate made with the openssl CLI (no Python crypto dependency)."""
    key, cert = tmp_path / "tls.key", tmp_path / "tls.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return key, cert


async def test_tcp_is_off_by_default_and_serves_tls_when_configured(
    tmp_path: Path, pods: list[str]
) -> None:
    async with running_sidecar(sidecar_config(tmp_path, pods)) as (sidecar, _):
        assert sidecar.tcp_port is None
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a test certificate")
    key, cert = self_signed(tmp_path)
    port = free_port()
    config = sidecar_config(
        tmp_path,
        pods,
        tcp_listen=f"127.0.0.1:{port}",
        tls_cert_file=str(cert),
        tls_key_file=str(key),
    )
    async with running_sidecar(config) as (sidecar, _):
        assert sidecar.tcp_port == port
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            reply = await router_pb2_grpc.RouterStub(channel).ListBackends(
                router_pb2.ListBackendsRequest(), timeout=5
            )
        assert sorted(b.url for b in reply.backends) == sorted(pods)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await router_pb2_grpc.RouterStub(plain).ListBackends(
                    router_pb2.ListBackendsRequest(), timeout=2
                )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
