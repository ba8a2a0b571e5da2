"""`prefix-sidecar inject` on a realistic multi-document bundle (tests/deploy/manifests):
what is added, what is left alone byte for byte, idempotency, opt-out, errors, and the
injected output against the strict Kubernetes schemas."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefix_sidecar_tools import inject
from tests.cli import run_cli

from .conftest import validate_k8s

SHOP = Path(__file__).parent / "manifests" / "shop.yaml"
SOCKET_TARGET = "unix:///var/run/prefix-sidecar/sidecar.sock"


def run_inject(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("inject", *args, stdin=stdin)


def by_name(text: str) -> dict[str, dict[str, Any]]:
    """kind/name -> object, List items included."""
    found: dict[str, dict[str, Any]] = {}
    for doc in yaml.safe_load_all(text):
        for obj in doc.get("items", [doc]) if doc["kind"] == "List" else [doc]:
            found[f"{obj['kind'].lower()}/{obj['metadata']['name']}"] = obj
    return found


def template_spec(obj: dict[str, Any]) -> dict[str, Any]:
    path = inject.TEMPLATE_PATHS[obj["kind"]]
    node = obj
    for key in path:
        node = node[key]
    spec: dict[str, Any] = node["spec"]
    return spec


def sidecars(spec: dict[str, Any]) -> list[dict[str, Any]]:
    every = [*spec.get("initContainers", []), *spec["containers"]]
    return [c for c in every if c["name"] == inject.SIDECAR_NAME]


@pytest.fixture(scope="module")
def shop() -> str:
    return SHOP.read_text()


@pytest.fixture(scope="module")
def injected(shop: str) -> inject.InjectResult:
    return inject.inject_text(shop, inject.InjectOptions())


def test_every_workload_gets_one_sidecar_and_each_app_container_the_socket(
    injected: inject.InjectResult,
) -> None:
    objects = by_name(injected.text)
    for label in (
        "deployment/merchant-api",
        "statefulset/script-writer",
        "pod/debug-shell",
        "deployment/coupon-calculator",
        "cronjob/nightly-compliance-report",
    ):
        spec = template_spec(objects[label])
        assert len(sidecars(spec)) == 1, label
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[inject.SOCKET_VOLUME] == {"name": inject.SOCKET_VOLUME, "emptyDir": {}}
        assert volumes[inject.CONFIG_VOLUME]["configMap"]["name"] == inject.DEFAULT_CONFIGMAP
        for container in spec["containers"]:
            if container["name"] == inject.SIDECAR_NAME:
                continue
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert mounts[inject.SOCKET_VOLUME] == inject.DEFAULT_SOCKET_DIR, label
            env = [e for e in container["env"] if e["name"] == inject.SOCKET_ENV]
            assert env == [{"name": inject.SOCKET_ENV, "value": SOCKET_TARGET}], label
    api = template_spec(objects["deployment/merchant-api"])
    assert [c["name"] for c in api["containers"]] == ["api", "log-shipper", "prefix-sidecar"]
    # What the app had stays: its own volume, mount, env and its multi-line script.
    assert api["volumes"][0] == {"name": "settings", "configMap": {"name": "merchant-api-settings"}}
    assert api["containers"][0]["env"][0] == {"name": "LOG_LEVEL", "value": "info"}
    assert api["containers"][0]["args"] == ["./migrate --wait\nexec ./server --port 8080\n"]
    assert api["securityContext"]["fsGroup"] == inject.SIDECAR_UID
    assert sorted(injected.injected) == sorted(
        [
            "deployment/merchant-api",
            "statefulset/script-writer",
            "pod/debug-shell",
            "deployment/coupon-calculator",
            "cronjob/nightly-compliance-report (native sidecar)",
        ]
    )


def test_documents_that_are_not_workloads_are_untouched_and_in_order(
    shop: str, injected: inject.InjectResult
) -> None:
    before = inject.split_documents(shop)
    after = inject.split_documents(injected.text)
    assert len(before) == len(after)
    kinds = [yaml.safe_load(c.body)["kind"] for c in before]
    assert [yaml.safe_load(c.body)["kind"] for c in after] == kinds
    for old, new, kind in zip(before, after, kinds, strict=True):
        assert new.separator == old.separator
        if kind in ("Service", "ConfigMap", "DaemonSet"):  # the DaemonSet opted out
            assert new.body == old.body, kind
    assert "# the public API" in injected.text  # comments of untouched documents survive


def test_existing_fsgroup_and_socket_env_are_kept(injected: inject.InjectResult) -> None:
    writer = template_spec(by_name(injected.text)["statefulset/script-writer"])
    assert writer["securityContext"] == {"runAsNonRoot": True, "fsGroup": 2000}
    env = writer["containers"][0]["env"]
    assert [e["name"] for e in env] == [inject.SOCKET_ENV]


def test_jobs_get_a_native_sidecar_that_lets_them_complete(
    injected: inject.InjectResult,
) -> None:
    job = template_spec(by_name(injected.text)["cronjob/nightly-compliance-report"])
    assert [c["name"] for c in job["containers"]] == ["report"]
    (sidecar,) = job["initContainers"]
    assert sidecar["name"] == inject.SIDECAR_NAME
    assert sidecar["restartPolicy"] == "Always"
    assert "lifecycle" not in sidecar  # native sidecars are stopped after the app anyway


def test_opt_out_annotation_on_workload_or_template(injected: inject.InjectResult) -> None:
    objects = by_name(injected.text)
    for label in ("daemonset/node-exporter", "deployment/admin-ui"):
        assert sidecars(template_spec(objects[label])) == []
        assert (label, "annotation prefix-sidecar/inject: false") in injected.skipped


def test_injecting_twice_changes_nothing(injected: inject.InjectResult) -> None:
    again = inject.inject_text(injected.text, inject.InjectOptions())
    assert again.text == injected.text
    assert again.injected == []
    assert len([why for _, why in again.skipped if why == "already injected"]) == 5


def test_a_half_injected_workload_is_completed_without_duplicates(
    injected: inject.InjectResult,
) -> None:
    complete = by_name(injected.text)["deployment/merchant-api"]
    damaged = by_name(injected.text)["deployment/merchant-api"]
    spec = template_spec(damaged)
    spec["containers"][1].pop("env")  # log-shipper lost its env; the sidecar is still there
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != inject.CONFIG_VOLUME]
    result = inject.inject_text(yaml.safe_dump(damaged), inject.InjectOptions())
    assert yaml.safe_load(result.text) == complete
    assert result.injected == ["deployment/merchant-api"]


@pytest.mark.parametrize("native", [False, True], ids=["container", "native"])
def test_injected_output_passes_the_strict_kubernetes_schema(
    shop: str, native: bool, offline: None
) -> None:
    result = inject.inject_text(shop, inject.InjectOptions(native=native))
    objects = by_name(result.text)
    assert len(objects) == 10
    for obj in objects.values():
        validate_k8s(obj)


def test_cli_reads_stdin_and_reports_on_stderr(shop: str, injected: inject.InjectResult) -> None:
    done = run_inject("-f", "-", stdin=shop)
    assert done.returncode == 0, done.stderr
    assert done.stdout == injected.text
    assert "deployment/merchant-api injected" in done.stderr
    assert "daemonset/node-exporter skipped (annotation prefix-sidecar/inject: false)" in (
        done.stderr
    )


def test_cli_options_reach_the_manifest(tmp_path: Path) -> None:
    done = run_inject(
        "-f",
        str(SHOP),
        "--config",
        "llm-sidecar",
        "--image",
        "registry.example.com/prefix-sidecar:0.1.0",
        "--socket-dir",
        "/run/llm",
        "-q",
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    api = template_spec(by_name(done.stdout)["deployment/merchant-api"])
    (sidecar,) = sidecars(api)
    assert sidecar["image"] == "registry.example.com/prefix-sidecar:0.1.0"
    assert sidecar["args"][-2:] == ["--listen", "unix:///run/llm/sidecar.sock"]
    # The probes ask the metrics port over HTTP, wherever the socket goes.
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "sidecar-metrics"}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "sidecar-metrics"}
    assert "exec" not in sidecar["startupProbe"]
    volumes = {v["name"]: v for v in api["volumes"]}
    assert volumes[inject.CONFIG_VOLUME]["configMap"]["name"] == "llm-sidecar"
    assert api["containers"][0]["volumeMounts"][-1]["mountPath"] == "/run/llm"
    assert api["containers"][0]["env"][-1]["value"] == "unix:///run/llm/sidecar.sock"


def test_malformed_yaml_names_the_document_and_the_reason(shop: str) -> None:
    broken = shop.replace("  name: merchant-api-settings\n", "  name: [merchant-api-settings\n")
    done = run_inject("-f", "-", stdin=broken)
    assert done.returncode == 2
    assert done.stdout == ""
    assert "error: <stdin>: document 2 (line 13): malformed YAML" in done.stderr
    assert "at line 17, column 12" in done.stderr  # where the parser gave up, in file coordinates


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "kind: Deployment\nmetadata: {name: web}\nspec: {replicas: 1}\n",
            "document 1 (line 1): deployment/web has no spec.template mapping",
        ),
        (
            "kind: Pod\nmetadata: {name: p}\nspec: {}\n",
            "pod/p has no spec.containers list; is the manifest complete?",
        ),
        ("---\n- just\n- a list\n", "document 1 (line 2): not a Kubernetes object"),
        (
            "kind: Pod\nmetadata:\n  name: p\n  annotations: {prefix-sidecar/inject: nope}\n"
            "spec: {containers: [{name: a, image: a}]}\n",
            'use "false" to opt out',
        ),
        (
            "kind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - name: a\n    image: a\n"
            "    volumeMounts: [{name: tmp, mountPath: /var/run/prefix-sidecar}]\n",
            "already mounts volume 'tmp' at /var/run/prefix-sidecar; pick another --socket-dir",
        ),
    ],
    ids=["no-template", "no-containers", "not-an-object", "bad-annotation", "mount-clash"],
)
def test_bad_manifests_fail_with_what_to_fix(text: str, message: str) -> None:
    with pytest.raises(inject.InjectError, match=message.replace("(", r"\(").replace(")", r"\)")):
        inject.inject_text(text, inject.InjectOptions())


def test_bad_options_exit_2(tmp_path: Path) -> None:
    done = run_inject("-f", str(SHOP), "--config", "Not_A_Name")
    assert done.returncode == 2
    assert "is not a valid ConfigMap name" in done.stderr
    done = run_inject("-f", str(tmp_path / "missing.yaml"))
    assert done.returncode == 2
    assert "cannot read the manifest" in done.stderr


# --openai-port: the sidecar's OpenAI front on the pod's loopback, OPENAI_BASE_URL where asked.
OPENAI_PORT = 8081  # merchant-api in shop.yaml declares 8080 itself
OPENAI_URL = f"http://127.0.0.1:{OPENAI_PORT}/v1"
OPENAI_BUNDLE = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: chat-bot, namespace: shop}
spec:
  selector:
    matchLabels: {app: chat-bot}
  template:
    metadata:
      labels: {app: chat-bot}
      annotations: {prefix-sidecar/openai: "true"}     # every app container
    spec:
      containers:
        - {name: bot, image: registry.example.com/chat-bot:1.0.0}
        - name: summarizer
          image: registry.example.com/summarizer:1.0.0
          env:
            - {name: OPENAI_BASE_URL, value: "https://llm-gateway.example.com/v1"}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: writer, namespace: shop}
spec:
  selector:
    matchLabels: {app: writer}
  template:
    metadata:
      labels: {app: writer}
      annotations: {prefix-sidecar/openai: "api"}      # only the container named
    spec:
      containers:
        - {name: api, image: registry.example.com/writer:2.0.0, ports: [{containerPort: 8080}]}
        - {name: log-shipper, image: fluent/fluent-bit:3.1.4}
---
apiVersion: batch/v1
kind: CronJob
metadata:
  name: nightly-digest
  namespace: shop
  annotations: {prefix-sidecar/openai: "true"}         # on the workload: native sidecar
spec:
  schedule: "0 3 * * *"
  jobTemplate:
    spec:
      template:
        spec:
          restartPolicy: OnFailure
          containers:
            - {name: digest, image: registry.example.com/digest:1.0.0}
---
apiVersion: v1
kind: Pod
metadata: {name: grpc-only, namespace: shop}
spec:
  containers:
    - {name: app, image: registry.example.com/grpc-only:1.0.0}
"""


def openai_env(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in container.get("env", []) if e["name"] == inject.OPENAI_ENV]


@pytest.fixture(scope="module")
def with_openai() -> inject.InjectResult:
    return inject.inject_text(OPENAI_BUNDLE, inject.InjectOptions(openai_port=OPENAI_PORT))


def test_openai_port_starts_the_front_and_sets_the_base_url_of_apps_that_opt_in(
    with_openai: inject.InjectResult,
) -> None:
    objects = by_name(with_openai.text)
    for label in objects:
        (sidecar,) = sidecars(template_spec(objects[label]))
        assert sidecar["args"][-2:] == ["--openai-listen", f"127.0.0.1:{OPENAI_PORT}"], label
        # Loopback only: no containerPort, which would offer the port on the pod IP.
        assert [p["name"] for p in sidecar["ports"]] == [inject.METRICS_PORT_NAME], label
    apps = {
        f"{label}/{c['name']}": c
        for label, obj in objects.items()
        for c in template_spec(obj)["containers"]
        if c["name"] != inject.SIDECAR_NAME
    }
    wanted = [{"name": inject.OPENAI_ENV, "value": OPENAI_URL}]
    assert openai_env(apps["deployment/chat-bot/bot"]) == wanted
    assert openai_env(apps["deployment/writer/api"]) == wanted
    assert openai_env(apps["cronjob/nightly-digest/digest"]) == wanted
    assert openai_env(apps["deployment/writer/log-shipper"]) == []  # not named
    assert openai_env(apps["pod/grpc-only/app"]) == []  # no annotation: the front, no env
    # An app's own OPENAI_BASE_URL is kept, and said so (without its value).
    own = [{"name": inject.OPENAI_ENV, "value": "https://llm-gateway.example.com/v1"}]
    assert openai_env(apps["deployment/chat-bot/summarizer"]) == own
    (warning,) = with_openai.warnings
    assert "deployment/chat-bot: container 'summarizer' keeps its own OPENAI_BASE_URL" in warning
    assert "llm-gateway" not in warning
    # Every app still gets the socket, as without --openai-port.
    for name, container in apps.items():
        assert {"name": inject.SOCKET_ENV, "value": SOCKET_TARGET} in container["env"], name
    # The native sidecar (the CronJob's init container) listens before the app starts.
    digest = template_spec(objects["cronjob/nightly-digest"])
    assert digest["initContainers"][0]["restartPolicy"] == "Always"


def test_openai_args_parse_with_the_real_serve_parser(
    with_openai: inject.InjectResult, tmp_path: Path
) -> None:
    from prefix_sidecar import cli, config

    from .conftest import K8S_DIR, load_all

    (sidecar,) = sidecars(template_spec(by_name(with_openai.text)["deployment/chat-bot"]))
    config_map = next(
        doc
        for doc in load_all(K8S_DIR / "sidecar-config.yaml")
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == inject.DEFAULT_CONFIGMAP
    )
    (tmp_path / inject.CONFIG_FILE).write_text(config_map["data"][inject.CONFIG_FILE])
    mounted = f"{inject.CONFIG_DIR}/{inject.CONFIG_FILE}"
    args = [str(tmp_path / inject.CONFIG_FILE) if a == mounted else a for a in sidecar["args"]]
    argv = ["serve", *args]
    loaded = config.from_args(cli.build_parser(argv).parse_args(argv), env={})
    assert loaded.openai_listen == f"127.0.0.1:{OPENAI_PORT}"  # loopback: no TLS needed
    assert loaded.listen == SOCKET_TARGET
    assert f"http://{loaded.openai_listen}/v1" == OPENAI_URL


@pytest.mark.parametrize("native", [False, True], ids=["container", "native"])
def test_openai_output_passes_the_strict_kubernetes_schema(native: bool, offline: None) -> None:
    options = inject.InjectOptions(native=native, openai_port=OPENAI_PORT)
    objects = by_name(inject.inject_text(OPENAI_BUNDLE, options).text)
    assert len(objects) == 4
    for obj in objects.values():
        validate_k8s(obj)


def test_openai_injection_is_idempotent_and_completes_an_earlier_injection(
    with_openai: inject.InjectResult,
) -> None:
    options = inject.InjectOptions(openai_port=OPENAI_PORT)
    again = inject.inject_text(with_openai.text, options)
    assert again.text == with_openai.text
    assert again.injected == []
    assert len(again.skipped) == 4
    # Injected earlier without the front: the same pieces are added, nothing twice.
    plain = inject.inject_text(OPENAI_BUNDLE, inject.InjectOptions())
    upgraded = inject.inject_text(plain.text, options)
    assert by_name(upgraded.text) == by_name(with_openai.text)
    assert len(upgraded.injected) == 4
    # ...but a front already on another port is not moved behind the app's back.
    with pytest.raises(inject.InjectError, match=r"already has --openai-listen 127\.0\.0\.1:8081"):
        inject.inject_text(with_openai.text, inject.InjectOptions(openai_port=8082))


def test_without_openai_port_the_annotation_only_warns() -> None:
    result = inject.inject_text(OPENAI_BUNDLE, inject.InjectOptions())
    for obj in by_name(result.text).values():
        spec = template_spec(obj)
        assert "--openai-listen" not in sidecars(spec)[0]["args"]
        assert all(openai_env(c) == [] or c["name"] == "summarizer" for c in spec["containers"])
    assert sorted(w.split(":")[0] for w in result.warnings) == [
        "cronjob/nightly-digest",
        "deployment/chat-bot",
        "deployment/writer",
    ]
    assert "annotation prefix-sidecar/openai asks for OPENAI_BASE_URL" in result.warnings[0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "kind: Pod\nmetadata:\n  name: p\n  annotations: {prefix-sidecar/openai: worker}\n"
            "spec: {containers: [{name: a, image: a}]}\n",
            "annotation prefix-sidecar/openai names worker, not an app container of the pod (a)",
        ),
        (
            "kind: Pod\nmetadata:\n  name: p\n"
            "  annotations: {prefix-sidecar/openai: 'yes please'}\n"
            "spec: {containers: [{name: a, image: a}]}\n",
            'use "true" for every app container',
        ),
        (
            "kind: Pod\nmetadata: {name: p}\n"
            "spec: {containers: [{name: a, image: a, ports: [{containerPort: 8081}]}]}\n",
            "container 'a' declares containerPort 8081, and the pod's containers share one "
            "network namespace; pick another --openai-port",
        ),
    ],
    ids=["unknown-container", "bad-annotation", "port-clash"],
)
def test_bad_openai_manifests_fail_with_what_to_fix(text: str, message: str) -> None:
    with pytest.raises(inject.InjectError, match=message.replace("(", r"\(").replace(")", r"\)")):
        inject.inject_text(text, inject.InjectOptions(openai_port=OPENAI_PORT))


def test_cli_openai_port(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle.yaml"
    bundle.write_text(OPENAI_BUNDLE)
    done = run_inject("-f", str(bundle), "--openai-port", str(OPENAI_PORT), "-q")
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout
        == inject.inject_text(OPENAI_BUNDLE, inject.InjectOptions(openai_port=OPENAI_PORT)).text
    )
    # -q drops the summary, not the warning.
    assert done.stderr.splitlines() == [
        "prefix-sidecar inject: warning: deployment/chat-bot: container 'summarizer' keeps its "
        "own OPENAI_BASE_URL; it is not pointed at the sidecar's OpenAI front"
    ]
    for port, reason in (("0", "is not a port"), ("9464", "the sidecar's metrics port")):
        done = run_inject("-f", str(bundle), "--openai-port", port)
        assert done.returncode == 2
        assert reason in done.stderr
    # shop.yaml's merchant-api serves on 8080 itself.
    done = run_inject("-f", str(SHOP), "--openai-port", "8080")
    assert done.returncode == 2
    assert "deployment/merchant-api: container 'api' declares containerPort 8080" in done.stderr
