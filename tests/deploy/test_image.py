"""The container image, built and run for real with podman.

deploy/build-image.sh builds the image (a Debian base made by mmdebstrap, reused once made,
and deploy/Dockerfile on top), then the image runs the way the pod spec in deploy/k8s runs
it: the image's own user, read-only root filesystem, no capabilities, the socket directory
and the config as mounts, the config's prefixes loaded from the mounted directory. Emulated
vLLM pods serve it from the host (`--network host`: everything stays on 127.0.0.1). The test
checks health and the HTTP probes, a streamed Complete, that its Route answers agree with a
sidecar on the host running the same config, the socket's owner and mode, the image's
HEALTHCHECK, that the runtime-only image has no tooling, and that `podman stop` (SIGTERM) in
the middle of a stream turns /readyz 503 and lets the stream finish and the container exit 0.

Where podman cannot run, the tests say why and skip, except on CI, where .ci/run installs
podman: there a missing or broken podman fails. Marked `image` and `slow`.

The first test, offline and unmarked, checks that the pod spec in deploy/k8s runs this exact
image with the user, socket volume, probes and ports the Dockerfile declares.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from prefix_sidecar_tools import inject
from prefix_sidecar_tools.harness import free_port

from .conftest import K8S_DIR, ROOT, load_all
from .test_dockerfile import env_of, instructions, only, stages

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"localhost/prefix-sidecar:{VERSION}"
BASE_IMAGE = "localhost/debian-python:bookworm"
BUILD_SCRIPT = ROOT / "deploy" / "build-image.sh"
PODMAN_ENV = {
    **os.environ,
    "CONTAINERS_CONF": os.environ.get(
        "CONTAINERS_CONF", str(ROOT / "deploy" / "podman" / "containers.conf")
    ),
}
MODEL = "promo-assistant"
GRACE_S = 20
# The stream that SIGTERM interrupts: ~2.9 s at the emulator's 35 tokens/s.
DRAIN_TOKENS = 100
PREFIXES = {
    "compliance-rules": "You are the promotion compliance assistant. No absolute claims such as "
    "'lowest price ever'; discounts are computed from the lowest price of the last 30 days.\n",
    "live-stream-script": "You write live-stream sales scripts. State the final price after all "
    "coupons and never promise delivery dates the merchant has not confirmed.\n",
}


def sidecar_container() -> dict[str, Any]:
    (caller,) = [d for d in load_all(K8S_DIR / "caller.yaml") if d["kind"] == "Deployment"]
    containers = caller["spec"]["template"]["spec"]["containers"]
    (container,) = [c for c in containers if c["name"] == inject.SIDECAR_NAME]
    return {"pod": caller["spec"]["template"]["spec"], **container}


def test_the_k8s_pod_runs_this_image_with_its_user_volume_and_probes(offline: None) -> None:
    runtime = stages()[-1]
    sidecar = sidecar_container()
    # This exact image: the tag build-image.sh gives it (podman's localhost/ is the local
    # store, where an unqualified name resolves first).
    assert f"localhost/{sidecar['image']}" == IMAGE
    assert 'IMAGE="${IMAGE:-localhost/prefix-sidecar:$VERSION}"' in BUILD_SCRIPT.read_text()
    # The image's ENTRYPOINT runs (`serve`); the pod only appends arguments.
    assert "command" not in sidecar
    assert json.loads(only(runtime, "ENTRYPOINT")) == ["prefix-sidecar", "serve"]
    # The same user: the pod pins the image's USER, and its fsGroup is the image's group.
    uid, gid = (int(part) for part in only(runtime, "USER").split(":"))
    security = sidecar["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid)
    assert security["runAsNonRoot"] is True
    assert sidecar["pod"]["securityContext"]["fsGroup"] == gid
    # The same socket volume and path.
    (volume_dir,) = json.loads(only(runtime, "VOLUME"))
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert mounts[inject.SOCKET_VOLUME] == volume_dir
    volumes = {v["name"]: v for v in sidecar["pod"]["volumes"]}
    assert "emptyDir" in volumes[inject.SOCKET_VOLUME]
    listen = sidecar["args"][sidecar["args"].index("--listen") + 1]
    assert listen == env_of(runtime)["PREFIX_SIDECAR_LISTEN"] == f"unix://{volume_dir}/sidecar.sock"
    # The config mount is the directory the image makes for it.
    config = sidecar["args"][sidecar["args"].index("--config") + 1]
    assert mounts[inject.CONFIG_VOLUME] == str(Path(config).parent) == inject.CONFIG_DIR
    assert any(kw == "RUN" and f"mkdir -p {volume_dir} {inject.CONFIG_DIR}" in rest
               for kw, rest in runtime)  # fmt: skip
    # The metrics port the image exposes and turns on; the probes ask it over HTTP, and the
    # HEALTHCHECK asks it for the liveness probe's path.
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert list(ports.values()) == [int(only(runtime, "EXPOSE"))]
    assert env_of(runtime)["PREFIX_SIDECAR_METRICS_PORT"] == only(runtime, "EXPOSE")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert ports[sidecar[probe]["httpGet"]["port"]] == int(only(runtime, "EXPOSE")), probe
    healthcheck = json.loads(only(runtime, "HEALTHCHECK").split(" CMD ", 1)[1])
    assert sidecar["livenessProbe"]["httpGet"]["path"] in healthcheck[-1]
    # No build-time setting reaches the runtime stage.
    assert next(rest for kw, rest in instructions() if kw == "ARG").startswith("BASE_IMAGE=")
    assert not [rest for kw, rest in runtime if kw == "ARG"]


# --- the image, for real ---------------------------------------------------------------------


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["podman", *args], env=PODMAN_ENV, capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done


def podman_problem() -> str | None:
    """Why podman cannot build or run the image on this machine, or None."""
    missing = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
    if missing:
        packages = "podman buildah runc mmdebstrap"
        return f"{' and '.join(missing)} not installed (apt-get install {packages})"
    info = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if info.returncode != 0:
        return f"podman cannot run here: `podman info` says {info.stderr.strip()[-600:]}"
    if podman("image", "exists", BASE_IMAGE, check=False).returncode != 0 and not shutil.which(
        "mmdebstrap"
    ):
        return f"{BASE_IMAGE} is missing and mmdebstrap, which makes it, is not installed"
    return None


@dataclass(frozen=True)
class Built:
    image: str
    size: str
    seconds: float


@pytest.fixture(scope="module")
def built_image() -> Built:
    problem = podman_problem()
    if problem is not None:
        if os.environ.get("CI") and shutil.which("apt-get"):
            pytest.fail(f"{problem}; .ci/run installs podman on CI, so the image must run there")
        pytest.skip(problem)
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], env=PODMAN_ENV, capture_output=True, text=True, timeout=840
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, f"build-image.sh failed:\n{done.stderr[-5000:]}"
    image, size = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert image == IMAGE
    notes = [line for line in done.stderr.splitlines() if line.startswith("build-image:")]
    print(f"\n{image}: {size}, built in {seconds:.0f} s", *notes, sep="\n  ")
    return Built(image, size, seconds)


@pytest.fixture(scope="module")
def pods() -> Iterator[list[str]]:
    """Three emulated vLLM pods on 127.0.0.1, in their own process."""
    process = subprocess.Popen(
        [sys.executable, "-m", "prefix_sidecar.cli", "emulate", "--pods", "3", "--base-port", "0",
         "--model", MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("PODS "):
                yield line.split()[1].split(",")
                break
        else:
            pytest.fail(f"the emulator exited {process.wait()} before listing its pods")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Running:
    name: str
    config_dir: Path
    socket: Path
    seconds_to_socket: float
    metrics_port: int

    def get(self, path: str) -> tuple[int, str]:
        """GET the metrics port (the host's network is the container's): status and body."""
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError as exc:  # nothing listens (any more)
            return 0, str(exc)


@pytest.fixture(scope="module")
def container(
    built_image: Built, pods: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Running]:
    """The image, run as the pod spec runs it; removed afterwards."""
    config_dir, socket_dir = tmp_path_factory.mktemp("etc"), tmp_path_factory.mktemp("run")
    for path in (config_dir, socket_dir):
        path.chmod(0o755)
    # Prefix files by relative path: the same config file serves the container (workdir
    # /etc/prefix-sidecar) and the host sidecar (cwd config_dir).
    prefixes = []
    for index, (name, text) in enumerate(PREFIXES.items()):
        (config_dir / f"prefix-{index}.txt").write_text(text)
        prefixes.append({"name": name, "file": f"prefix-{index}.txt", "replicas": 2})
    config = {
        "backends": pods,
        "model": MODEL,
        "replicas": 2,
        "health_interval_s": 0.5,
        "warm_before_serve": True,
        "grace_s": GRACE_S,
        "prefixes": prefixes,
    }
    (config_dir / inject.CONFIG_FILE).write_text(yaml.safe_dump(config))
    name = f"prefix-sidecar-test-{os.getpid()}"
    # The host's network: a free port, not the image's 9464, so that runs can overlap.
    metrics_port = free_port()
    started = time.monotonic()
    podman(
        "run", "--detach", "--name", name, "--network", "host",
        "--env", f"PREFIX_SIDECAR_METRICS_PORT={metrics_port}",
        # The pod's securityContext: read-only root, no capabilities, no privilege escalation.
        "--read-only", "--read-only-tmpfs=false", "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        # :U gives the socket directory to the image's user, as the pod's fsGroup does.
        "--volume", f"{socket_dir}:{inject.DEFAULT_SOCKET_DIR}:U",
        "--volume", f"{config_dir}:{inject.CONFIG_DIR}:ro",
        "--workdir", inject.CONFIG_DIR,
        built_image.image, "--config", f"{inject.CONFIG_DIR}/{inject.CONFIG_FILE}",
    )  # fmt: skip
    socket = socket_dir / inject.SOCKET_FILE
    try:
        while not socket.exists():
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            if state != "running" or time.monotonic() - started > 60:
                logs = podman("logs", name, check=False)
                pytest.fail(f"no socket from the container ({state}):\n{logs.stderr[-3000:]}")
            time.sleep(0.02)
        seconds = time.monotonic() - started
        print(f"\ncontainer {name}: socket after {seconds:.2f} s")
        yield Running(name, config_dir, socket, seconds, metrics_port)
    finally:
        logs = podman("logs", name, check=False)
        print(f"\ncontainer log (tail):\n{logs.stderr[-2000:]}")
        podman("rm", "--force", "--time", "5", name, check=False)


def wait_serving(router: Any, pods: list[str], timeout: float = 30) -> None:
    from prefix_sidecar.v1 import router_pb2

    deadline = time.monotonic() + timeout
    while True:
        listed = router.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)
        states = {b.url: b.state for b in listed.backends}
        if states == dict.fromkeys(pods, "serving"):
            return
        assert time.monotonic() < deadline, f"pods not all serving: {states}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def router(container: Running, pods: list[str]) -> Iterator[Any]:
    from prefix_sidecar.v1 import router_pb2_grpc

    with grpc.insecure_channel(f"unix://{container.socket}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        wait_serving(stub, pods)
        yield stub


def image_test(test: Any) -> Any:
    """Marks a test that builds or runs the image (the cold build with mmdebstrap included)."""
    return pytest.mark.image(pytest.mark.slow(pytest.mark.timeout(900)(test)))


@image_test
def test_health_is_serving_and_the_healthcheck_passes(container: Running, router: Any) -> None:
    health = subprocess.run(
        [sys.executable, "-m", "prefix_sidecar.cli", "health", "--socket", str(container.socket)],
        capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert health.returncode == 0 and "SERVING" in health.stdout, health
    # The image's HEALTHCHECK, run by podman inside the container (no systemd, so no timer).
    checked = podman("healthcheck", "run", container.name, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    health_status = podman("inspect", "--format", "{{.State.Health.Status}}", container.name)
    assert health_status.stdout.strip() == "healthy"
    config = json.loads(podman("inspect", "--format", "{{json .Config.Healthcheck}}",
                               container.name).stdout)  # fmt: skip
    assert config["Test"][:4] == ["CMD", "python3", "-I", "-S"]
    # The probes over HTTP, as the kubelet asks them; the standard process metrics.
    assert container.get("/livez") == (200, "ok\n")
    assert container.get("/readyz") == (200, "ready\n")
    status, metrics = container.get("/metrics")
    assert status == 200
    assert "\nprocess_resident_memory_bytes " in metrics and "\nprocess_open_fds " in metrics


@image_test
def test_the_runtime_image_has_no_tooling(container: Running) -> None:
    """The runtime wheel has no prefix_sidecar_tools: a tooling verb names the extra."""
    demo = podman("exec", container.name, "prefix-sidecar", "demo", check=False)
    assert demo.returncode == 2, demo
    assert "pip install 'prefix-sidecar[tools]'" in demo.stderr, demo.stderr
    where = "import pathlib, prefix_sidecar; print(pathlib.Path(prefix_sidecar.__file__).parent)"
    package = podman("exec", container.name, "python3", "-c", where).stdout.strip()
    assert package.startswith("/opt/venv/"), package
    listed = podman("exec", container.name, "ls", str(Path(package).parent)).stdout.split()
    assert "prefix_sidecar" in listed and "prefix_sidecar_tools" not in listed, listed


@image_test
def test_the_socket_belongs_to_the_image_user_with_mode_0660(container: Running) -> None:
    status = container.socket.stat()
    uid, gid = (int(part) for part in only(stages()[-1], "USER").split(":"))
    assert (status.st_uid, status.st_gid) == (uid, gid)
    assert oct(status.st_mode & 0o7777) == oct(0o660)
    user = podman("exec", container.name, "id", "-u").stdout.strip()
    assert user == str(uid)


@image_test
def test_a_complete_streams_from_a_host_pod(router: Any, pods: list[str]) -> None:
    from prefix_sidecar.v1 import router_pb2

    request = router_pb2.CompleteRequest(
        prefix_name="compliance-rules", input="Is 'lowest price ever' allowed?", max_tokens=12
    )
    chunks = list(router.Complete(request, timeout=30))
    assert len(chunks) > 1, "not streamed"
    assert chunks[0].backend in pods
    assert "".join(c.text for c in chunks).strip()
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12
    # warm_before_serve prewarmed the configured prefix read from the config mount.
    assert chunks[-1].usage.cached_tokens > 0


@image_test
def test_routes_agree_with_a_sidecar_on_the_host_with_the_same_config(
    container: Running, router: Any, pods: list[str]
) -> None:
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

    host_socket = container.config_dir.parent / f"host-{os.getpid()}.sock"
    host = subprocess.Popen(
        [sys.executable, "-m", "prefix_sidecar.cli", "serve", "--config", inject.CONFIG_FILE,
         "--listen", f"unix://{host_socket}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=container.config_dir,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not host_socket.exists():
            assert host.poll() is None, f"the host sidecar exited {host.returncode}"
            assert time.monotonic() < deadline, "the host sidecar never bound its socket"
            time.sleep(0.05)
        targets = [router_pb2.RouteRequest(prefix_name=name) for name in PREFIXES]
        targets += [router_pb2.RouteRequest(prompt=f"merchant {i}: flash sale?") for i in range(40)]
        with grpc.insecure_channel(f"unix://{host_socket}") as channel:
            on_host = router_pb2_grpc.RouterStub(channel)
            wait_serving(on_host, pods)
            for request in targets:
                theirs = on_host.Route(request, timeout=5)
                ours = router.Route(request, timeout=5)
                what = request.WhichOneof("target")
                assert (ours.backend, list(ours.preference), ours.route_key, ours.branch) == (
                    theirs.backend, list(theirs.preference), theirs.route_key, theirs.branch,
                ), f"{what}={getattr(request, what)!r}"  # fmt: skip
            backends = {on_host.Route(r, timeout=5).backend for r in targets}
            assert len(backends) > 1, "every target on one pod: agreement proves little"
    finally:
        host.send_signal(signal.SIGTERM)
        try:
            host.wait(GRACE_S + 10)
        except subprocess.TimeoutExpired:
            host.kill()
            host.wait()


@image_test
def test_sigterm_during_a_stream_drains_it_and_the_container_exits_0(
    container: Running, router: Any
) -> None:
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc

    request = router_pb2.CompleteRequest(
        prefix_name="live-stream-script", input="A script for a 499 yuan jacket.",
        max_tokens=DRAIN_TOKENS,
    )  # fmt: skip
    stream = router.Complete(request, timeout=60)
    chunks = [next(stream)]
    ended: list[float] = []

    def read_the_rest() -> None:
        chunks.extend(stream)
        ended.append(time.monotonic())

    reader = threading.Thread(target=read_the_rest, daemon=True)
    reader.start()
    # SIGTERM now, then up to GRACE_S + 10 s before podman would SIGKILL.
    stopper = subprocess.Popen(
        ["podman", "stop", "--time", str(GRACE_S + 10), container.name],
        env=PODMAN_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    signalled = time.monotonic()
    # Draining: new calls are refused while the stream goes on.
    refused_at = None
    with grpc.insecure_channel(f"unix://{container.socket}") as channel:
        fresh = router_pb2_grpc.RouterStub(channel)
        while refused_at is None and reader.is_alive():
            try:
                fresh.Route(router_pb2.RouteRequest(prompt="still open?"), timeout=1)
                time.sleep(0.05)
            except grpc.RpcError:
                refused_at = time.monotonic()
    # Not ready while it drains (the kubelet takes the pod out of its Services), still alive.
    drain_probes = (container.get("/readyz"), container.get("/livez"))
    reader.join(60)
    _, stop_err = stopper.communicate(timeout=GRACE_S + 20)
    stopped = time.monotonic()
    assert ended, "the stream did not end"
    assert refused_at is not None and refused_at < ended[0], "SIGTERM arrived after the stream"
    assert drain_probes == ((503, "not ready: draining: shutting down\n"), (200, "ok\n"))
    # The stream finished whole ...
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == DRAIN_TOKENS
    # ... and the container exited by itself, 0, soon after it (not SIGKILL at the timeout).
    code = podman("inspect", "--format", "{{.State.ExitCode}}", container.name).stdout.strip()
    assert code == "0", f"exit {code}: {stop_err}"
    assert stopped - signalled < GRACE_S, f"stop took {stopped - signalled:.1f} s"
    assert not container.socket.exists(), "the socket outlived the sidecar"
    print(
        f"\ndrain: SIGTERM {ended[0] - signalled:.2f} s before the stream's end, "
        f"refused new calls after {refused_at - signalled:.2f} s, "
        f"container gone {stopped - signalled:.2f} s after SIGTERM"
    )
