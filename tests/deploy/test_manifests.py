"""deploy/k8s against the Kubernetes schemas (offline, strict) and against each other: the
Service selects the vLLM pods, the sidecar config names that Service, the caller is exactly
what `prefix-sidecar inject` produces, and the config loads with the sidecar's own loader."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefix_sidecar_tools import inject

from .conftest import K8S_DIR, load_all, validate_k8s

MANIFESTS = sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in MANIFESTS:
        for doc in load_all(path):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _sidecar_config() -> dict[str, Any]:
    config_map = _objects()[("ConfigMap", inject.DEFAULT_CONFIGMAP)]
    data: dict[str, Any] = yaml.safe_load(config_map["data"][inject.CONFIG_FILE])
    return data


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_passes_the_strict_kubernetes_schema(path: Path, offline: None) -> None:
    docs = load_all(path)
    assert docs, f"{path} holds no objects"
    for doc in docs:
        validate_k8s(doc)


def test_the_schema_check_catches_mistakes(offline: None) -> None:
    vllm = copy.deepcopy(_objects()[("Deployment", "vllm")])
    vllm["spec"]["replicas"] = "eight"
    with pytest.raises(AssertionError, match=r"spec\.replicas"):
        validate_k8s(vllm)
    typo = copy.deepcopy(_objects()[("Deployment", "merchant-assistant")])
    _pod_spec(typo)["containers"][1]["livenesProbe"] = {}  # unknown field, strict mode
    with pytest.raises(AssertionError, match="livenesProbe"):
        validate_k8s(typo)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


def test_headless_service_publishes_the_ready_vllm_pods() -> None:
    objects = _objects()
    vllm, service = objects[("Deployment", "vllm")], objects[("Service", "vllm-headless")]
    pod_labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"  # DNS answers with the pod IPs
    assert service["spec"].get("publishNotReadyAddresses", False) is False
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert vllm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container = _pod_spec(vllm)["containers"][0]
    assert "readinessProbe" in container  # readiness is what gates DNS membership
    assert "--enable-prefix-caching" in container["args"]
    # The opt-out annotation keeps `inject` away from the fleet itself.
    annotations = vllm["spec"]["template"]["metadata"]["annotations"]
    assert annotations[inject.OPT_OUT_ANNOTATION] == "false"


def test_sidecar_config_names_the_headless_service_by_fqdn() -> None:
    objects = _objects()
    service = objects[("Service", "vllm-headless")]
    port = service["spec"]["ports"][0]["port"]
    namespace = service["metadata"]["namespace"]
    expected = f"vllm-headless.{namespace}.svc.cluster.local:{port}"
    assert _sidecar_config()["backends_dns"] == expected


def test_sidecar_asks_for_the_model_name_vllm_serves() -> None:
    args = _pod_spec(_objects()[("Deployment", "vllm")])["containers"][0]["args"]
    served = [a.split("=", 1)[1] for a in args if a.startswith("--served-model-name=")]
    assert served == [_sidecar_config()["model"]]


def test_pdb_covers_the_vllm_pods_one_at_a_time() -> None:
    objects = _objects()
    pdb, vllm = objects[("PodDisruptionBudget", "vllm")], objects[("Deployment", "vllm")]
    pod_labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    assert vllm["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_every_container_has_requests_and_limits() -> None:
    for (kind, name), obj in _objects().items():
        if kind != "Deployment":
            continue
        for container in _pod_spec(obj)["containers"]:
            resources = container.get("resources", {})
            where = f"{name}/{container['name']}"
            assert resources.get("requests"), f"{where} has no resource requests"
            assert resources.get("limits", {}).get("memory"), f"{where} has no memory limit"


def test_caller_is_exactly_what_inject_produces() -> None:
    caller = _objects()[("Deployment", "merchant-assistant")]
    plain = copy.deepcopy(caller)
    spec = _pod_spec(plain)
    spec["containers"] = [c for c in spec["containers"] if c["name"] != inject.SIDECAR_NAME]
    for container in spec["containers"]:
        del container["volumeMounts"], container["env"]
    del spec["volumes"], spec["securityContext"]
    text = yaml.safe_dump(plain, sort_keys=False)
    injected = inject.inject_text(text, inject.InjectOptions())
    assert yaml.safe_load(injected.text) == caller
    # ...and injecting the committed file again changes no byte.
    committed = (K8S_DIR / "caller.yaml").read_text()
    again = inject.inject_text(committed, inject.InjectOptions())
    assert again.text == committed
    assert again.injected == []


def test_probes_and_socket_agree_with_the_config(tmp_path: Path) -> None:
    from prefix_sidecar import cli, config
    from prefix_sidecar.server.common import probes

    caller = _objects()[("Deployment", "merchant-assistant")]
    sidecar = next(c for c in _pod_spec(caller)["containers"] if c["name"] == inject.SIDECAR_NAME)
    assert sidecar["args"][sidecar["args"].index("--listen") + 1] == _sidecar_config()["listen"]
    # `serve` parses the container's args over a config file that leaves metrics off, on
    # loopback: the args still put the metrics port, where the probes ask, on the pod IP.
    plain = {**_sidecar_config(), "metrics_port": 0, "metrics_host": "127.0.0.1"}
    (tmp_path / inject.CONFIG_FILE).write_text(yaml.safe_dump(plain))
    mounted = f"{inject.CONFIG_DIR}/{inject.CONFIG_FILE}"
    args = [str(tmp_path / inject.CONFIG_FILE) if a == mounted else a for a in sidecar["args"]]
    argv = ["serve", *args]
    loaded = config.from_args(cli.build_parser(argv).parse_args(argv), env={})
    assert (loaded.metrics_host, loaded.metrics_port) == ("0.0.0.0", inject.METRICS_PORT)
    assert loaded.listen == _sidecar_config()["listen"]
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {inject.METRICS_PORT_NAME: inject.METRICS_PORT}
    assert _sidecar_config()["metrics_port"] == inject.METRICS_PORT
    paths = {"startupProbe": probes.READY_PATH, "readinessProbe": probes.READY_PATH,
             "livenessProbe": probes.LIVE_PATH}  # fmt: skip
    for probe, path in paths.items():
        assert sidecar[probe]["httpGet"] == {"path": path, "port": inject.METRICS_PORT_NAME}
    assert (inject.READY_PATH, inject.LIVE_PATH) == (probes.READY_PATH, probes.LIVE_PATH)


def test_prefix_files_are_in_the_config_map() -> None:
    config_map = _objects()[("ConfigMap", inject.DEFAULT_CONFIGMAP)]
    for prefix in _sidecar_config()["prefixes"]:
        directory, _, key = prefix["file"].rpartition("/")
        assert directory == inject.CONFIG_DIR, f"{prefix['file']} is outside the config mount"
        assert config_map["data"].get(key, "").strip(), f"ConfigMap has no {key} for {prefix}"


def test_sidecar_config_loads_with_the_sidecars_loader() -> None:
    from prefix_sidecar import config as sidecar_config  # the lead's loader: the real judge

    loaded = sidecar_config.build_config(_sidecar_config(), env={}, overrides={})
    assert loaded.backends_dns.startswith("vllm-headless.")
    assert loaded.socket_path == "/var/run/prefix-sidecar/sidecar.sock"
    assert [p.name for p in loaded.prefixes] == ["compliance-rules", "live-stream-script"]
