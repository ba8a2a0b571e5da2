"""Packaging tells the truth: the runtime never imports the tooling, and the declared lower
bounds of the dependencies are enough - a fresh venv with exactly those versions imports the
generated stubs, serves, and a tooling verb whose extra is missing says which to install."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What only the tooling extras bring. Not h2: dnspython imports httpx for DNS-over-HTTPS when
# it is installed (the openai SDK brings it in the test venv), and httpx's HTTP/2 imports h2.
TOOLING_ONLY = ("hypothesis", "uhashring", "matplotlib", "llama_cpp")


def runtime_modules() -> list[str]:
    """Every module of the package but the tooling and the generated stubs."""
    names = []
    for path in sorted((ROOT / "sidecar").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[1] in ("tools", "v1"):
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_no_runtime_module_imports_the_tooling_in_its_source() -> None:
    offenders = []
    for name in runtime_modules():
        path = ROOT / Path(*name.split("."))
        source = (
            path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
        )
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom):
                imported = [node.module or ""]
            elif isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            else:
                continue
            offenders += [f"{name}: {m}" for m in imported if m.startswith("sidecar.tools")]
    assert not offenders


def test_importing_the_whole_runtime_loads_no_tooling() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for name in {runtime_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    loaded = set(eval(done.stdout))  # a JSON list of strings is a Python literal
    assert not {m for m in loaded if m.startswith("sidecar.tools")}
    assert not loaded & set(TOOLING_ONLY)


def declared_minimums() -> list[str]:
    """`name==lower bound` for every runtime dependency in pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = []
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,<[0-9.]+)?", requirement)
        assert match, f"{requirement!r}: every dependency needs a >= lower bound"
        pins.append(f"{match.group(1)}=={match.group(2)}")
    return pins


@pytest.mark.slow
def test_the_declared_minimum_versions_are_enough(tmp_path: Path) -> None:
    env = {**os.environ, "SIDECAR_NO_EXTENSIONS": "1"}  # the dependencies are the subject
    env.pop("PYTHONPATH", None)
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", str(wheels), str(ROOT)], check=True, env=env, timeout=300)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *declared_minimums()], check=True, env=env, timeout=600)
    wheel = next(wheels.glob("prefix_sidecar-*.whl"))
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, env=env, timeout=120)

    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "prefix-sidecar")
    run_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}  # not this checkout
    versions = subprocess.run(
        [python, "-c", "import grpc, google.protobuf as p; print(grpc.__version__, p.__version__)"],
        capture_output=True, text=True, env=run_env, cwd=tmp_path, check=True,
    ).stdout.split()  # fmt: skip
    pinned = dict(pin.split("==") for pin in declared_minimums())
    assert versions == [pinned["grpcio"], pinned["protobuf"]]
    stubs = "from sidecar.v1 import router_pb2, router_pb2_grpc; import sidecar.server.app"
    done = subprocess.run(
        [python, "-c", stubs], capture_output=True, text=True, env=run_env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]

    socket_path = tmp_path / "s.sock"
    serve = subprocess.Popen(
        [cli, "serve", "--listen", f"unix://{socket_path}", "--backend", "http://127.0.0.1:9"],
        env=run_env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        health = [cli, "health", "--socket", str(socket_path)]
        for _ in range(100):
            done = subprocess.run(health, capture_output=True, text=True, env=run_env, timeout=10)
            if done.returncode == 0:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert done.returncode == 0 and "SERVING" in done.stdout, done.stdout + done.stderr
    finally:
        serve.terminate()
        _, stderr = serve.communicate(timeout=30)
    assert serve.returncode == 0, stderr[-3000:]

    fuzz = subprocess.run(
        [cli, "fuzz", "--cases", "1"], capture_output=True, text=True, env=run_env, cwd=tmp_path
    )
    assert fuzz.returncode == 2
    assert "pip install 'prefix-sidecar[tools]'" in fuzz.stderr, fuzz.stderr
