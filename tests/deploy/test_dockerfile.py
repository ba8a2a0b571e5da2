"""deploy/Dockerfile, read statically: a lint of its instructions, and its builder stage's
`pip wheel .` replayed for real on the build context that deploy/Dockerfile.dockerignore lets
through (the wheel must carry the Cython core, the generated gRPC modules and the entry point).
tests/deploy/test_image.py builds and runs the image itself with podman."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from prefix_sidecar import cli
from prefix_sidecar_tools import inject
from prefix_sidecar_tools.harness import free_port

from .conftest import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
IGNORE_FILE = ROOT / "deploy" / "Dockerfile.dockerignore"
PINNED_PYTHON = re.compile(r"^python:3\.\d+\.\d+-slim-(bookworm|trixie)$")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not pending:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        if (pending + line).strip():
            logical.append(pending + line)
        pending = ""
    parsed = []
    for text in logical:
        keyword, _, rest = text.strip().partition(" ")
        parsed.append((keyword.upper(), " ".join(rest.split())))
    return parsed


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each stage; what comes before the first FROM is dropped."""
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, rest))
    return result


def only(stage: list[tuple[str, str]], keyword: str) -> str:
    values = [rest for kw, rest in stage if kw == keyword]
    assert len(values) == 1, f"expected one {keyword} in the final stage, got {values}"
    return values[0]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    pairs = " ".join(rest for kw, rest in stage if kw == "ENV").split()
    return dict(pair.split("=", 1) for pair in pairs)


def test_both_stages_use_one_base_image_pinned_by_default() -> None:
    """The venv built in the builder (the Cython core included) runs on the runtime's Python
    and glibc: both stages must be the same BASE_IMAGE, whatever the build passes."""
    preamble = list(itertools.takewhile(lambda i: i[0] != "FROM", instructions()))
    (default,) = [rest.split("=", 1)[1] for kw, rest in preamble if kw == "ARG"]
    assert PINNED_PYTHON.match(default), f"{default} is not pinned to an exact slim tag"
    images = [rest.split()[0] for kw, rest in instructions() if kw == "FROM"]
    assert images == ["${BASE_IMAGE}", "${BASE_IMAGE}"], "a builder and a runtime stage"


def test_builder_builds_the_venv_and_runtime_only_copies_it() -> None:
    builder, runtime = stages()
    runs = [rest for kw, rest in builder if kw == "RUN"]
    # A compiler for the Cython core; Python.h from python3-dev where the base lacks it.
    assert any("gcc" in run and "python3-dev" in run and "Python.h" in run for run in runs)
    assert any(run == "python3 -m venv /opt/venv" for run in runs)
    (install,) = [run for run in runs if "pip wheel" in run]
    assert "--wheel-dir /wheels ." in install
    # `serve` needs the project without extras, offline from the wheels just built.
    assert "pip install --no-cache-dir --no-index --find-links=/wheels prefix-sidecar " in install
    assert "pip uninstall -y -q pip setuptools" in install
    assert env_of(builder)["PATH"].startswith("/opt/venv/bin:")
    # The runtime stage installs nothing: no package manager, no compiler, no index settings.
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in runtime
    assert not [rest for kw, rest in runtime if kw == "RUN" and ("pip" in rest or "apt" in rest)]
    assert not [rest for kw, rest in runtime if kw == "ARG"]
    assert env_of(runtime)["PATH"].startswith("/opt/venv/bin:")


def test_runtime_runs_serve_as_the_non_root_user_the_manifests_expect() -> None:
    runtime = stages()[-1]
    user = only(runtime, "USER")
    assert user.split(":")[0] not in ("root", "0")
    assert user == f"{inject.SIDECAR_UID}:{inject.SIDECAR_UID}"
    assert json.loads(only(runtime, "ENTRYPOINT")) == ["prefix-sidecar", "serve"]
    assert f"/{inject.METRICS_PORT}" not in only(runtime, "EXPOSE")
    assert only(runtime, "EXPOSE") == str(inject.METRICS_PORT)


def healthcheck_command() -> list[str]:
    command: list[str] = json.loads(only(stages()[-1], "HEALTHCHECK").split(" CMD ", 1)[1])
    return command


def test_socket_dir_is_a_volume_and_metrics_serve_the_probes_on_the_exposed_port() -> None:
    runtime = stages()[-1]
    assert json.loads(only(runtime, "VOLUME")) == [inject.DEFAULT_SOCKET_DIR]
    socket_path = f"{inject.DEFAULT_SOCKET_DIR}/{inject.SOCKET_FILE}"
    assert env_of(runtime)["PREFIX_SIDECAR_LISTEN"] == f"unix://{socket_path}"
    # The HEALTHCHECK and the k8s probes ask the metrics port, so the image turns it on.
    assert env_of(runtime)["PREFIX_SIDECAR_METRICS_PORT"] == str(inject.METRICS_PORT)
    # The image's Python and the standard library only: no curl, no gRPC client.
    command = healthcheck_command()
    assert command[:4] == ["python3", "-I", "-S", "-c"]
    assert inject.LIVE_PATH in command[-1] and "PREFIX_SIDECAR_METRICS_PORT" in command[-1]
    assert "serve" in cli.COMMANDS


@pytest.mark.timeout(60)
async def test_the_healthcheck_command_passes_on_livez_and_fails_without_it() -> None:
    """The HEALTHCHECK's command, run as the container runs it, against the real endpoints."""
    from prefix_sidecar.metrics import Metrics, start_metrics_server
    from prefix_sidecar.server.common.probes import Readiness, probe_routes

    async def healthcheck(port: int) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, *healthcheck_command()[1:],
            env={"PREFIX_SIDECAR_METRICS_PORT": str(port)},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(process.communicate(), 30)
        return int(process.returncode or 0), out.decode()

    port = free_port()
    readiness = Readiness()  # not ready (no pods): liveness does not care
    runner = await start_metrics_server(Metrics(), "127.0.0.1", port, probe_routes(readiness))
    try:
        assert await healthcheck(port) == (0, "")
    finally:
        await runner.cleanup()
    code, out = await healthcheck(port)
    assert code == 1 and "Connection refused" in out


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore syntax (Go filepath.Match plus `**`), as a regex."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def build_context(destination: Path) -> list[str]:
    """Copy what the ignore file lets into the build context; returns the relative paths."""
    rules = []
    for line in IGNORE_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negate = line.startswith("!")
            rules.append((negate, _pattern_regex(line.lstrip("!").strip("/"))))

    def excluded(relative: str) -> bool:
        parts = relative.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        verdict = False
        for negate, regex in rules:  # the last matching rule wins, as in Docker
            if any(regex.fullmatch(p) for p in prefixes):
                verdict = not negate
        return verdict

    copied = []
    for path in sorted(ROOT.rglob("*")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.split("/")[0] in (".git", ".venv") or not path.is_file():
            continue
        if not excluded(relative):
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            copied.append(relative)
    return copied


def test_ignore_file_sends_sources_only(tmp_path: Path) -> None:
    copied = build_context(tmp_path)
    assert {"pyproject.toml", "setup.py", "csrc/_core_c.pyx", "prefix_sidecar/cli.py"} <= set(
        copied
    )
    assert "proto/prefix_sidecar/v1/router.proto" in copied
    skipped = ("prefix_sidecar/v1/", "build/", "tests/", "examples/", "docs/", "deploy/")
    leaked = [p for p in copied if p.endswith((".so", ".pyc")) or p.startswith(skipped)]
    assert leaked == []


@pytest.mark.timeout(240)
def test_builder_stage_makes_a_complete_wheel(tmp_path: Path) -> None:
    context, wheels = tmp_path / "context", tmp_path / "wheels"
    build_context(context)
    (context / "README.md").touch()  # the lead's README may not exist yet in a checkout
    # What `RUN pip wheel .` does in the builder, offline: build deps come from this venv.
    # The builder has no SIDECAR_NO_EXTENSIONS (set by the pure-Python test pass).
    env = {k: v for k, v in os.environ.items() if k != "SIDECAR_NO_EXTENSIONS"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(wheels), str(context)],
        capture_output=True, text=True, timeout=220, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = wheels.glob("prefix_sidecar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert any(re.fullmatch(r"prefix_sidecar/_core_c\..*\.so", n) for n in names), "no Cython core"
    for module in (
        "prefix_sidecar/v1/router_pb2.py",
        "prefix_sidecar/v1/router_pb2_grpc.py",
        "prefix_sidecar/cli.py",
        "prefix_sidecar/server/app.py",
    ):
        assert module in names, f"the wheel lacks {module}: the image could not serve"
    tooling = [n for n in names if n.startswith("prefix_sidecar_tools/")]
    assert tooling == [], "the runtime wheel carries the tooling"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert (
        "prefix-sidecar = prefix_sidecar.cli:main"
        in zipfile.ZipFile(wheel).read(entry_points).decode()
    )
