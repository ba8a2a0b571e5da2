"""`prefix-sidecar serve` config: a bad field fails at start naming it; file < env < flags;
--prefix NAME=FILE:REPLICAS loads (and warms) prefixes at start."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest

from prefix_sidecar import _core
from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
from prefix_sidecar_tools.emulator import get_stats

from .conftest import CLI, cli_env, cli_sidecar, owner_ring, wait_serving


def serve(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "serve", *args],
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--set", "load_factor=0.5"], {}, ["'load_factor'", ">= 1.0"]),
        (["--set", "max_attempts=0"], {}, ["'max_attempts'", ">= 1"]),
        (["--set", "socket_mode=rw"], {}, ["'socket_mode'", "octal"]),
        (["--set", "socket_mode=0o1777"], {}, ["'socket_mode'", "0777"]),
        (["--set", "load_factr=1.5"], {}, ["unknown config field 'load_factr'"]),
        (["--listen", "/tmp/x.sock"], {}, ["'listen'", "unix://"]),
        (["--health-path", "health"], {}, ["'health_path'", "'/'"]),
        ([], {"PREFIX_SIDECAR_REPLICAS": "two"}, ["'replicas'", "integer"]),
        (["--prefix", "rules"], {}, ["NAME=FILE"]),
        (["--config", "/nonexistent/sidecar.yaml"], {}, ["/nonexistent/sidecar.yaml"]),
    ],
)
def test_bad_config_exits_2_naming_the_field(
    args: list[str], env: dict[str, str], words: list[str]
) -> None:
    result = serve("--backend", "http://127.0.0.1:9", *args, **env)
    assert result.returncode == 2, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_bad_values_found_only_at_start_also_exit_2(tmp_path: Path) -> None:
    listen = f"unix://{tmp_path}/s.sock"
    bad_url = serve("--listen", listen, "--backend", "http://user@10.0.0.1:8000")
    assert bad_url.returncode == 2 and "credentials" in bad_url.stderr
    missing = serve("--listen", listen, "--backend", "http://127.0.0.1:9", "--prefix", "r=/no/file")
    assert missing.returncode == 2 and "'r'" in missing.stderr and "/no/file" in missing.stderr
    none = serve("--listen", listen)
    assert none.returncode == 2 and "--backend" in none.stderr
    assert "Traceback" not in bad_url.stderr + missing.stderr + none.stderr


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text(
        "backends: [http://10.0.0.1:8000, {url: http://10.0.0.2:8000, weight: 2}]\n"
        "replicas: 2\nload_factor: 1.5\nmax_attempts: 4\nhealth_path: /v1/models\n",
        encoding="utf-8",
    )
    result = serve(
        "--config",
        str(config),
        "--set",
        "max_attempts=6",
        "--print-config",
        PREFIX_SIDECAR_LOAD_FACTOR="1.75",
        PREFIX_SIDECAR_MAX_ATTEMPTS="5",
        PREFIX_SIDECAR_API_KEY="sk-do-not-print-me",
    )
    assert result.returncode == 0, result.stderr
    merged = json.loads(result.stdout)
    assert merged["backends"] == [["http://10.0.0.1:8000", 1], ["http://10.0.0.2:8000", 2]]
    assert merged["replicas"] == 2  # file
    assert merged["load_factor"] == 1.75  # env over file
    assert merged["max_attempts"] == 6  # flag over env
    assert merged["health_path"] == "/v1/models"
    assert "sk-do-not-print-me" not in result.stdout + result.stderr


async def test_prefixes_from_flags_and_settings_from_env_reach_the_running_sidecar(
    tmp_path: Path, pods: list[str]
) -> None:
    rules = tmp_path / "rules.txt"
    rules.write_text("平台营销合规规则：禁止使用绝对化用语。" * 500, encoding="utf-8")
    script = tmp_path / "script.txt"
    script.write_text("Live-stream script template. " * 300, encoding="utf-8")
    config = tmp_path / "sidecar.yaml"
    config.write_text(
        "backends:\n" + "".join(f"  - {url}\n" for url in pods) + "health_interval_s: 0.5\n",
        encoding="utf-8",
    )
    args = [
        "--config",
        str(config),
        "--prefix",
        f"rules={rules}:2",
        "--prefix",
        f"script={script}",
    ]
    async with (
        cli_sidecar(tmp_path, args, PREFIX_SIDECAR_REPLICAS="2") as sidecar,
        grpc.aio.insecure_channel(sidecar.target) as channel,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        await wait_serving(stub, pods, timeout=10.0)
        listed = await stub.ListPrefixes(router_pb2.ListPrefixesRequest())
        stats = await asyncio.gather(*(get_stats(url) for url in pods))

    prefixes: dict[str, Any] = {p.name: p for p in listed.prefixes}
    assert sorted(prefixes) == ["rules", "script"]
    text = rules.read_text(encoding="utf-8")
    assert prefixes["rules"].replicas == 2
    assert prefixes["rules"].bytes == len(text.encode())
    key = _core.route_key(text.encode())
    assert list(prefixes["rules"].backends) == owner_ring(pods).preference(key, 2)
    assert prefixes["script"].replicas == 2  # the env's default replicas
    script_key = _core.route_key(script.read_text(encoding="utf-8").encode())
    assert list(prefixes["script"].backends) == owner_ring(pods).preference(script_key, 2)
    # Loaded at start, so warmed before the pods served: each home pod prefilled it.
    warmed = {url for url, s in zip(pods, stats, strict=True) if s["requests"]}
    homes = set(prefixes["rules"].backends) | set(prefixes["script"].backends)
    assert warmed == homes


def test_socket_mode_from_env_is_octal() -> None:
    result = serve(
        "--backend", "http://10.0.0.1:8000", "--print-config", PREFIX_SIDECAR_SOCKET_MODE="640"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["socket_mode"] == "0o640"


@pytest.mark.parametrize("mode", ["660", "0660", "440", "0o600"])
def test_socket_mode_from_a_flag_is_octal_too(mode: str) -> None:
    result = serve(
        "--backend", "http://10.0.0.1:8000", "--set", f"socket_mode={mode}", "--print-config"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["socket_mode"] == "0o" + mode.removeprefix("0o").lstrip("0")


def test_socket_mode_440_in_the_yaml_file_is_octal(tmp_path: Path) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text("backends: [http://10.0.0.1:8000]\nsocket_mode: 440\n", encoding="utf-8")
    result = serve("--config", str(config), "--print-config")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["socket_mode"] == "0o440"


async def test_json_log_lines_from_a_real_serve_process(tmp_path: Path, pods: list[str]) -> None:
    args = ["--backend", pods[0], "--set", "log_format=json", "--set", "health_interval_s=0.5"]
    async with (
        cli_sidecar(tmp_path, args, name="json") as sidecar,
        grpc.aio.insecure_channel(sidecar.target) as channel,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        await wait_serving(stub, pods[:1], timeout=10.0)
        request = router_pb2.CompleteRequest(input="is 'lowest price ever' allowed?", max_tokens=3)
        chunks = [
            chunk async for chunk in stub.Complete(request, metadata=[("x-request-id", "r-1")])
        ]
        assert chunks
    lines = [line for line in sidecar.log_text().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries), entries
    (request_entry,) = [e for e in entries if e["logger"] == "sidecar.requests"]
    assert request_entry["level"] == "info"
    assert request_entry["message"].startswith("Complete prefix=- backend=")
    assert request_entry["status"] == "OK" and request_entry["backend"] == pods[0]
    assert request_entry["completion_tokens"] == 3 and request_entry["attempts"] == 1
    assert request_entry["request_id"] == "r-1" and request_entry["prefix"] in (None, "-")
    assert isinstance(request_entry["ttft_ms"], float) and request_entry["total_ms"] > 0
    assert 0 < request_entry["decision_ms"] < request_entry["total_ms"]
