"""The example caller pod of deploy/k8s, replayed on this machine with real processes.

What the kubelet would do is done by hand: the ConfigMap's keys become files (the config
mount), a directory stands in for the socket emptyDir, the sidecar container's `args` run
after the image's ENTRYPOINT (`prefix-sidecar serve`), and its startup probe's httpGet is
polled on the container's metrics port. The headless Service is a real DNS server on
127.0.0.1 that answers vllm-headless.llm.svc.cluster.local with an A record (127.0.0.1) and an
AAAA record (::1), one emulated vLLM pod behind each, on the same port as in a cluster. So the
committed config, args and probes are the ones that start, discover, prewarm, serve and drain
here."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from dnslib import AAAA, QTYPE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from prefix_sidecar_tools import inject
from tests.cli import start_cli

from .conftest import K8S_DIR, load_all

SERVICE_NAME = "vllm-headless.llm.svc.cluster.local"
POD_IPS = ("127.0.0.1", "::1")


class HeadlessService(BaseResolver):
    """A/AAAA answers for the headless Service name, as CoreDNS gives them (TTL 5 s)."""

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        reply = request.reply()
        if str(request.q.qname).rstrip(".") == SERVICE_NAME:
            qtype = QTYPE[request.q.qtype]
            for ip in POD_IPS:
                if qtype == "A" and ":" not in ip:
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=5))
                if qtype == "AAAA" and ":" in ip:
                    reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(ip), ttl=5))
        return reply


@pytest.fixture
def dns_port() -> Iterator[int]:
    server = DNSServer(
        HeadlessService(), port=0, address="127.0.0.1", logger=DNSLogger(logf=lambda _: None)
    )
    thread = threading.Thread(
        target=server.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield int(server.server.server_address[1])
    server.server.shutdown()
    server.server.server_close()


def free_port_on_both_families() -> int:
    """A port free on ::1 and 127.0.0.1 alike; the v6 pick may be taken on v4 (CI88: by
    another test's process), so a few picks are tried."""
    for _ in range(20):
        with socket.socket(socket.AF_INET6) as v6, socket.socket() as v4:
            v6.bind(("::1", 0))
            port = int(v6.getsockname()[1])
            try:
                v4.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no port free on both ::1 and 127.0.0.1 in 20 picks")


def caller_objects() -> tuple[dict[str, Any], dict[str, str]]:
    objects = {d["metadata"]["name"]: d for d in load_all(K8S_DIR / "caller.yaml")}
    caller = objects["merchant-assistant"]
    sidecar = next(
        c for c in caller["spec"]["template"]["spec"]["containers"]
        if c["name"] == inject.SIDECAR_NAME
    )  # fmt: skip
    config_map = load_all(K8S_DIR / "sidecar-config.yaml")[0]
    return sidecar, config_map["data"]


def served_model_name() -> str:
    vllm = next(d for d in load_all(K8S_DIR / "vllm.yaml") if d["kind"] == "Deployment")
    args = vllm["spec"]["template"]["spec"]["containers"][0]["args"]
    (name,) = [a.split("=", 1)[1] for a in args if a.startswith("--served-model-name=")]
    return str(name)


def in_sandbox(value: str, config_dir: Path, socket_dir: Path) -> str:
    """Map the pod's mount paths to this test's directories."""
    return value.replace(inject.CONFIG_DIR, str(config_dir)).replace(
        inject.DEFAULT_SOCKET_DIR, str(socket_dir)
    )


def http_get(url: str) -> tuple[int, str]:
    """What the kubelet's httpGet probe sees: the status (0: no answer) and the body."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


async def test_the_caller_pod_starts_discovers_prewarms_serves_and_drains(
    tmp_path: Path, dns_port: int
) -> None:
    from prefix_sidecar.v1 import router_pb2, router_pb2_grpc
    from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator

    sidecar, data = caller_objects()
    config_dir, socket_dir = tmp_path / "etc", tmp_path / "run"
    config_dir.mkdir()
    socket_dir.mkdir()
    # The config mount: every key of the ConfigMap is a file.
    for key, text in data.items():
        (config_dir / key).write_text(in_sandbox(text, config_dir, socket_dir))
    port = free_port_on_both_families()
    config = yaml.safe_load((config_dir / inject.CONFIG_FILE).read_text())
    name, _, cluster_port = config["backends_dns"].rpartition(":")
    assert name == SERVICE_NAME and cluster_port == "8000"
    # Only what a laptop differs in: the pods' port, where DNS is, metrics on loopback.
    config.update(backends_dns=f"{name}:{port}", dns_nameserver=f"127.0.0.1:{dns_port}")
    (config_dir / inject.CONFIG_FILE).write_text(yaml.safe_dump(config))
    metrics_port = free_port_on_both_families()
    laptop = {
        f"metrics_port={inject.METRICS_PORT}": f"metrics_port={metrics_port}",
        "metrics_host=0.0.0.0": "metrics_host=127.0.0.1",
    }
    args = [laptop.get(a, in_sandbox(a, config_dir, socket_dir)) for a in sidecar["args"]]
    assert len(set(args) & set(laptop.values())) == 2, f"the args moved the metrics: {args}"
    # The probe's named port is the container's metrics port, here on loopback.
    probe = sidecar["startupProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports[probe["port"]] == inject.METRICS_PORT
    probe_url = f"http://127.0.0.1:{metrics_port}{probe['path']}"
    target = f"unix://{socket_dir}/{inject.SOCKET_FILE}"
    pods = [f"http://{ip}:{port}" if ":" not in ip else f"http://[{ip}]:{port}" for ip in POD_IPS]

    async with contextlib.AsyncExitStack() as stack:
        # The pods serve the model under vLLM's --served-model-name from vllm.yaml.
        pod_config = EmulatorConfig(time_scale=20, model=served_model_name())
        for ip in POD_IPS:
            await stack.enter_async_context(run_emulator(pod_config, port=port, host=ip))
        serve = await start_cli(
            "serve", *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        try:
            # The startup probe, as the kubelet runs it: until it answers 2xx.
            for _ in range(120):
                code, out = await asyncio.to_thread(http_get, probe_url)
                if 200 <= code < 300:
                    break
                assert serve.returncode is None, "the sidecar exited during startup"
                await asyncio.sleep(0.25)
            else:
                pytest.fail(f"startup probe never passed: {code} {out}")
            assert out == "ready\n"

            async with grpc.aio.insecure_channel(target) as channel:
                router = router_pb2_grpc.RouterStub(channel)
                # Discovery: both records of the headless Service, one A and one AAAA.
                for _ in range(50):
                    backends = await router.ListBackends(router_pb2.ListBackendsRequest())
                    if sorted(b.url for b in backends.backends if b.healthy) == sorted(pods):
                        break
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail(f"pods not discovered through DNS: {backends}")
                # The prefixes of the ConfigMap are registered at start, on both pods.
                listed = await router.ListPrefixes(router_pb2.ListPrefixesRequest())
                prefixes = {p.name: p for p in listed.prefixes}
                assert set(prefixes) == {"compliance-rules", "live-stream-script"}
                assert prefixes["compliance-rules"].bytes == len(data["compliance.txt"].encode())
                # warm_before_serve: a completion of a configured prefix hits a warm cache.
                for _ in range(50):
                    backends = await router.ListBackends(router_pb2.ListBackendsRequest())
                    if all(b.state == "serving" for b in backends.backends):
                        break
                    await asyncio.sleep(0.1)
                request = router_pb2.CompleteRequest(
                    prefix_name="compliance-rules", input="Is 'lowest price ever' allowed?",
                    max_tokens=4,
                )  # fmt: skip
                chunks = [c async for c in router.Complete(request, timeout=30)]
                assert chunks[0].backend in pods
                usage = chunks[-1].usage
                assert usage.cached_tokens > 0, f"the prefix was not prewarmed: {usage}"
        finally:
            # Pod deletion: SIGTERM, then the sidecar drains within grace_s and exits.
            if serve.returncode is None:
                serve.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(serve.communicate(), config["grace_s"] + 10)
        assert serve.returncode == 0, stderr.decode()[-2000:]
        assert not (socket_dir / inject.SOCKET_FILE).exists()
