"""The C++ example client (examples/cpp) against a real sidecar backed by emulated vLLM pods.

Builds the client with make (system protoc + grpc_cpp_plugin, Debian's libgrpc++), runs it
against a sidecar on a unix socket, and checks that its answers are the Python clients':
the Route reply from the generated Python stub and from `prefix-sidecar route --json`, the
prefix id (SHA-256 of the text), and a streamed completion that the second time is served
from the pod's prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from tests.cli import start_cli

from .conftest import ROOT

CPP_DIR = ROOT / "examples" / "cpp"
CLIENT = CPP_DIR / "build" / "prefix-sidecar-client"
PODS = 3
MAX_TOKENS = 6
ROUTE_FIELDS = ("backend", "preference", "prefix_id", "route_key", "branch")
# ~6 KB of fat prefix, so that the pod's prefix cache has whole blocks to reuse.
PREFIX = "You are the promotion compliance assistant.\n" + "".join(
    f"Rule {i}: a discount must be computed from the lowest price of the last 30 days.\n"
    for i in range(80)
)
QUERY = "Set up a 2-for-15%-off plus cross-store discount for this 499 yuan down jacket."


def _missing_toolchain() -> str | None:
    for tool in ("g++", "make", "pkg-config", "protoc", "grpc_cpp_plugin"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    probe = subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"], check=False)
    if probe.returncode != 0:
        return "pkg-config finds no grpc++/protobuf"
    return None


_MISSING = _missing_toolchain()
pytestmark = pytest.mark.skipif(
    _MISSING is not None,
    reason=f"C++ gRPC toolchain missing ({_MISSING}): apt-get install g++ make pkg-config "
    "libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc",
)


@pytest.fixture(scope="module")
def cpp_client() -> Path:
    """make is incremental: a fresh checkout compiles once (~10 s on 2 cores)."""
    done = subprocess.run(
        ["make", "-C", str(CPP_DIR), "-j2"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"building the C++ client failed:\n{done.stdout}\n{done.stderr}"
    assert CLIENT.is_file()
    return CLIENT


@contextlib.asynccontextmanager
async def sidecar_with_pods(socket_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """PODS emulated pods + one in-process sidecar on `socket_path`; yields (target, urls)."""
    from prefix_sidecar.config import build_config
    from prefix_sidecar.server.app import Sidecar
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
    from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator

    async with contextlib.AsyncExitStack() as stack:
        pod_config = EmulatorConfig(time_scale=20)
        urls = [await stack.enter_async_context(run_emulator(pod_config)) for _ in range(PODS)]
        config = build_config(
            env={},
            overrides={
                "listen": f"unix://{socket_path}",
                "backends": urls,
                "health_interval_s": 0.2,
                "grace_s": 0.5,
            },
        )
        sidecar = await stack.enter_async_context(Sidecar(config))
        # Every sidecar routes over the healthy pods only: wait until all three are.
        async with grpc.aio.insecure_channel(sidecar.target) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for _ in range(100):
                reply = await stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)
                if sum(b.healthy for b in reply.backends) == PODS:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"pods never all healthy: {reply}")
        yield sidecar.target, urls


async def run_cpp(client: Path, target: str, *extra: str) -> list[dict[str, Any]]:
    process = await asyncio.create_subprocess_exec(
        str(client), "--target", target, "--name", "compliance-rules",
        "--prefix-text", PREFIX, "--input", QUERY, "--max-tokens", str(MAX_TOKENS), *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()
    return [json.loads(line) for line in stdout.decode().splitlines()]


async def python_cli_route(target: str) -> dict[str, Any]:
    process = await start_cli(
        "route", "--socket", target, "--prefix-name", "compliance-rules", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()
    result: dict[str, Any] = json.loads(stdout)
    return result


def one(lines: list[dict[str, Any]], rpc: str, field: str) -> dict[str, Any]:
    (found,) = [line[field] for line in lines if line["rpc"] == rpc and field in line]
    result: dict[str, Any] = found
    return result


async def test_cpp_client_agrees_with_the_python_clients(cpp_client: Path, tmp_path: Path) -> None:
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

    async with sidecar_with_pods(tmp_path / "sidecar.sock") as (target, urls):
        first = await run_cpp(cpp_client, target)

        prefix = one(first, "RegisterPrefix", "reply")
        assert prefix["id"] == hashlib.sha256(PREFIX.encode()).hexdigest()
        assert prefix["name"] == "compliance-rules"
        assert int(prefix["bytes"]) == len(PREFIX.encode())

        # The C++ client's Route reply, read back into the proto, against the Python stub's.
        cpp_route = json_format.Parse(
            json.dumps(one(first, "Route", "reply")), router_pb2.RouteReply()
        )
        async with grpc.aio.insecure_channel(target) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            by_name = await stub.Route(
                router_pb2.RouteRequest(prefix_name="compliance-rules"), timeout=10
            )
            by_prompt = await stub.Route(router_pb2.RouteRequest(prompt=PREFIX + QUERY), timeout=10)
        for python_route in (by_name, by_prompt):
            for name in ROUTE_FIELDS:
                assert getattr(cpp_route, name) == getattr(python_route, name), name
        assert cpp_route.backend in urls
        assert sorted(cpp_route.preference) == sorted(urls)
        assert cpp_route.prefix_id == prefix["id"]
        assert cpp_route.route_key == int(prefix["route_key"])
        assert cpp_route.backend == prefix["backends"][0]  # the owner of the replica set

        # ...and against the Python command line client (`prefix-sidecar route --json`).
        cli_route = await python_cli_route(target)
        for name in ROUTE_FIELDS:
            assert str(cli_route[name]) == str(one(first, "Route", "reply")[name]), name

        # The stream came from the routed pod, chunk by chunk, usage on the last chunk.
        chunks = [line["chunk"] for line in first if "chunk" in line]
        summary = one(first, "Complete", "summary")
        assert chunks and chunks[0]["backend"] == cpp_route.backend
        assert "".join(c["text"] for c in chunks) == summary["text"] != ""
        assert summary["finish_reason"] == "length"
        assert summary["usage"]["completion_tokens"] == MAX_TOKENS
        assert "usage" in chunks[-1]

        # Re-registering is idempotent, routing is stable, and this time the pod serves the
        # fat prefix from its KV cache: the point of the whole exercise.
        second = await run_cpp(cpp_client, target)
        assert one(second, "RegisterPrefix", "reply")["id"] == prefix["id"]
        assert one(second, "Route", "reply")["backend"] == cpp_route.backend
        usage = one(second, "Complete", "summary")["usage"]
        assert usage["cached_tokens"] >= 0.9 * usage["prompt_tokens"] > 0


async def test_cpp_client_reports_a_failed_call(cpp_client: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-sidecar.sock"
    process = await asyncio.create_subprocess_exec(
        str(cpp_client), "--target", f"unix://{missing}", "--name", "x", "--prefix-text", "y",
        "--deadline-ms", "500",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 1
    assert stdout == b""
    assert b"RegisterPrefix failed: code 14" in stderr  # UNAVAILABLE
    bad = await asyncio.create_subprocess_exec(
        str(cpp_client), "--target", "localhost:1", "--name", "x", "--prefix-text", "y",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, bad_stderr = await asyncio.wait_for(bad.communicate(), timeout=30)
    assert bad.returncode == 2
    assert b"--target must be the sidecar's unix socket" in bad_stderr
