"""A small `bench organic --json` report, for the tools that read one (`--against`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The report's pods (what its runs' per-pod loads name) and its trace's settings
REPORT_PODS = [f"http://127.0.0.1:{port}" for port in (40001, 40002, 40003)]
REPORT_PARAMS: dict[str, Any] = {
    "seed": 3,
    "duration": 8.0,
    "tenants": 6,
    "templates": 3,
    "zipf": 1.0,
    "tenant_rate": 4.0,
    "fewshot_rate": 3.0,
    "session_rate": 0.7,
    "kv_tokens": 12_000,
    "prefill_tps": 1_500.0,
    "warmup": 2.0,
}
# run -> (the report's path, its pods)
WriteReport = Callable[[dict[str, Any]], tuple[str, list[str]]]


@pytest.fixture
def organic_report(tmp_path: Path) -> WriteReport:
    """Writes a report whose every run is `run` (with the pods' loads) under the names a
    real report has, on grpc-chat and http-chat; returns its path and its pods."""

    def write(run: dict[str, Any]) -> tuple[str, list[str]]:
        run = {**run, "load": {**run.get("load", {}), "per_pod": dict.fromkeys(REPORT_PODS, 0)}}
        names = ("window", "sidecar", "sidecar_x2", "wide_x2", "radix")
        report = {
            "params": REPORT_PARAMS,
            "paths": {
                "grpc-chat": dict.fromkeys(names, run),
                "http-chat": {"sidecar": run},
            },
        }
        path = tmp_path / "organic.json"
        path.write_text(json.dumps(report))
        return str(path), list(REPORT_PODS)

    return write
