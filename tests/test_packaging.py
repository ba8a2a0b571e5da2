"""Packaging tells the truth: the runtime never imports the tooling, and the declared lower
bounds of the dependencies are enough - a fresh venv with exactly those versions imports the
generated stubs, serves (the gRPC socket and the OpenAI HTTP front), and a tooling verb whose
extra is missing says which to install."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prefix_sidecar_tools.harness import free_port
from tests.runtime_tree import runtime_modules

ROOT = Path(__file__).resolve().parents[1]
# What only the tooling extras bring. Not h2: dnspython imports httpx for DNS-over-HTTPS when
# it is installed (the openai SDK brings it in the test venv), and httpx's HTTP/2 imports h2.
TOOLING_ONLY = ("hypothesis", "uhashring", "matplotlib", "llama_cpp")


def test_no_runtime_module_imports_the_tooling_in_its_source() -> None:
    offenders = []
    modules = runtime_modules()
    assert len(modules) > 100, "the walk found too few modules to mean anything"
    for name, source in modules.items():
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom):
                imported = [node.module or ""]
            elif isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            else:
                continue
            offenders += [f"{name}: {m}" for m in imported if m.startswith("prefix_sidecar_tools")]
    assert not offenders


def test_importing_the_whole_runtime_loads_no_tooling() -> None:
    names = list(runtime_modules())
    assert len(names) > 100, "the walk found too few modules to mean anything"
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    loaded = set(eval(done.stdout))  # a JSON list of strings is a Python literal
    assert not {m for m in loaded if m.startswith("prefix_sidecar_tools")}
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
    stubs = (
        "from prefix_sidecar.v1 import router_pb2, router_pb2_grpc; "
        "import prefix_sidecar.server.app"
    )
    done = subprocess.run(
        [python, "-c", stubs], capture_output=True, text=True, env=run_env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]

    socket_path = tmp_path / "s.sock"
    front = f"127.0.0.1:{free_port()}"
    with _stdlib_pod() as pod:
        serve = subprocess.Popen(
            [cli, "serve", "--listen", f"unix://{socket_path}", "--backend", pod,
             "--openai-listen", front],
            env=run_env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            health = [cli, "health", "--socket", str(socket_path)]
            for _ in range(100):
                done = subprocess.run(
                    health, capture_output=True, text=True, env=run_env, timeout=10
                )
                if done.returncode == 0:
                    break
                time.sleep(0.1)
            assert done.returncode == 0 and "SERVING" in done.stdout, done.stdout + done.stderr
            _the_front_relays(f"http://{front}")
        finally:
            serve.terminate()
            _, stderr = serve.communicate(timeout=30)
    assert serve.returncode == 0, stderr[-3000:]

    fuzz = subprocess.run(
        [cli, "fuzz", "--cases", "1"], capture_output=True, text=True, env=run_env, cwd=tmp_path
    )
    assert fuzz.returncode == 2
    assert "pip install 'prefix-sidecar[tools]'" in fuzz.stderr, fuzz.stderr


def _the_front_relays(base: str) -> None:
    """The OpenAI front on the minimum aiohttp: ready, a whole answer with the caller's
    unknown field passed as written, and a stream to its [DONE]."""
    for _ in range(100):
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as reply:
                if reply.status == 200:
                    break
        except OSError:
            time.sleep(0.1)
    whole = _post(base, b'{"model": "m", "prompt": "x", "unknown": [1.50]}')
    assert json.loads(whole)["seen"] == '{"model": "m", "prompt": "x", "unknown": [1.50]}'
    streamed = _post(base, b'{"model": "m", "prompt": "x", "stream": true}').decode()
    assert streamed.startswith("data: {") and streamed.endswith("data: [DONE]\n\n"), streamed


def _post(base: str, body: bytes) -> bytes:
    request = urllib.request.Request(
        base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200
        return bytes(reply.read())


class _PodHandler(BaseHTTPRequestHandler):
    """A pod from the standard library (the minimum venv has no emulator): /health,
    /v1/models, and completions answered whole (echoing the body it got) or streamed."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *_: object) -> None:
        pass

    def do_GET(self) -> None:
        models = {"object": "list", "data": [{"id": "m", "object": "model"}]}
        self._send(b"ok" if self.path == "/health" else json.dumps(models).encode())

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        if not json.loads(raw).get("stream"):
            choice = {"index": 0, "text": "hi", "finish_reason": "stop"}
            self._send(json.dumps({"choices": [choice], "seen": raw.decode()}).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for finish in (None, "stop"):
            choice = {"index": 0, "text": "hi", "finish_reason": finish}
            event = b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def _stdlib_pod() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PodHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
