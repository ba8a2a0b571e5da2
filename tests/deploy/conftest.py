"""Shared helpers for the deploy tests: repository paths and an OFFLINE Kubernetes schema
check. kubernetes-validate ships the JSON schemas; the `offline` fixture turns any network
connection into a test failure, so a schema fetch could not hide."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# A hard import: the schema checks must not turn into skips on a machine that lacks it.
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
# The oldest version with native sidecars (KEP-753, on by default from 1.29) and the newest
# one the installed kubernetes-validate knows.
K8S_VERSIONS = ("1.29", kv_utils.latest_version())


def validate_k8s(obj: dict[str, Any]) -> None:
    """Strict schema validation (unknown fields are errors) against every K8S_VERSIONS."""
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            name = (obj.get("metadata") or {}).get("name")
            raise AssertionError(
                f"{obj.get('kind')}/{name} fails the {version} schema at {path}: {exc.message}"
            ) from None


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any TCP/UDP connection to a non-loopback address fails the test."""
    real_connect = socket.socket.connect

    def guarded(self: socket.socket, address: Any) -> Any:
        host = address[0] if isinstance(address, tuple) else address
        remote = isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost")
        if remote and self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"network access to {address} during an offline test")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield
