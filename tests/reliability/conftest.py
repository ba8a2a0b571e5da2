"""Shared parts for the bad-input and security tests: one fuzz target (an emulator pod and a
sidecar, each a real process) per module, certificate generation, and a fixture starting
tiny aiohttp pods (tests/fake_pod.py) that record request headers or answer garbage.

The part-B tests (faults, soak, shutdown) keep their own fixtures in their own files.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from prefix_sidecar_tools.fuzz import Fuzzer, FuzzTarget
from tests.fake_pod import FakePod, Handler, ok_stream, recording_pod
from tests.server.conftest import running_sidecar, sidecar_config


@pytest.fixture(scope="module")
def fuzz_target() -> Iterator[FuzzTarget]:
    target = FuzzTarget()
    with target:
        yield target
    target.cleanup()


@pytest.fixture(scope="module")
def fuzzer(fuzz_target: FuzzTarget) -> Fuzzer:
    return Fuzzer(fuzz_target, timeout_s=10.0, probe_every=250)


# --- certificates --------------------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA nobody trusts, with a client cert it signed
    other_client_cert: Path
    other_client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN={name}", cwd=directory)  # fmt: skip


def _leaf(directory: Path, name: str, ca: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
             cwd=directory)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=directory)  # fmt: skip


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a server cert for 127.0.0.1/localhost and a client cert, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to generate test certificates")
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
          "extendedKeyUsage=serverAuth\n")  # fmt: skip
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "intruder", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Certs(
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
        other_ca=d / "other-ca.pem",
        other_client_cert=d / "intruder.pem",
        other_client_key=d / "intruder.key",
    )


# --- a tiny pod that records or misbehaves ---------------------------------------------------


@pytest.fixture
async def fake_pod() -> AsyncIterator[Callable[..., Awaitable[FakePod]]]:
    """`pod = await fake_pod(handler)`: start a pod whose inference paths run `handler`."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(handler: Handler = ok_stream) -> FakePod:
            return await stack.enter_async_context(recording_pod(handler))

        yield start


# --- an in-process sidecar ---------------------------------------------------------------------


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Callable[..., contextlib.AbstractAsyncContextManager[Any]]:
    """`async with start_sidecar([url, ...], **config_fields) as (sidecar, stub):` the server
    tests' sidecar, with a shorter drain (these pods answer at once or not at all)."""

    def start(backends: list[str], **values: object) -> contextlib.AbstractAsyncContextManager[Any]:
        return running_sidecar(sidecar_config(tmp_path, backends, **{"grace_s": 1.0, **values}))

    return start
