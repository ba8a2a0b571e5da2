"""`prefix-sidecar inject`: add the prefix-sidecar container to Kubernetes workloads.

Works like `linkerd inject` / `istioctl kube-inject`: reads a multi-document YAML file (or
stdin with `-f -`), adds the sidecar to the pod template of every Deployment, StatefulSet,
DaemonSet, ReplicaSet, Job, CronJob and Pod, and writes the result to stdout.

Documents are split the way kubectl splits them (a line starting with `---`), so a document
that needs no change is written back byte for byte, comments included; only injected
documents are re-serialised. Injection is "ensure" style: each piece (volumes, the sidecar
container, the socket mount and env of each app container) is added only when missing, so
injecting twice changes nothing and a half-injected workload gets completed.

With `--openai-port PORT` the sidecar also serves its OpenAI HTTP front on the pod's loopback
(`--openai-listen 127.0.0.1:PORT`; the pod's containers share one network namespace), and the
app containers that opt in with the annotation `prefix-sidecar/openai` get
`OPENAI_BASE_URL=http://127.0.0.1:PORT/v1`. An app's own OPENAI_BASE_URL is kept, with a warning.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

SIDECAR_NAME = "prefix-sidecar"
SOCKET_VOLUME = "prefix-sidecar-socket"
CONFIG_VOLUME = "prefix-sidecar-config"
DEFAULT_IMAGE = "prefix-sidecar:0.1.0"
DEFAULT_CONFIGMAP = "prefix-sidecar-config"
DEFAULT_SOCKET_DIR = "/var/run/prefix-sidecar"
SOCKET_FILE = "sidecar.sock"
CONFIG_DIR = "/etc/prefix-sidecar"
CONFIG_FILE = "sidecar.yaml"
SOCKET_ENV = "PREFIX_SIDECAR_SOCKET"
OPT_OUT_ANNOTATION = "prefix-sidecar/inject"
# "true": every app container gets OPENAI_BASE_URL; or a comma-separated list of container names.
OPENAI_ANNOTATION = "prefix-sidecar/openai"
OPENAI_ENV = "OPENAI_BASE_URL"
OPENAI_FLAG = "--openai-listen"
METRICS_PORT = 9464
METRICS_PORT_NAME = "sidecar-metrics"
# httpGet probe paths, served on the metrics port (prefix_sidecar/server/common/probes.py).
LIVE_PATH = "/livez"
READY_PATH = "/readyz"
# The image's non-root user and group (deploy/Dockerfile).
SIDECAR_UID = 65532

# kind -> path from the object to its pod template ({metadata, spec}); Pod is its own template.
TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": (),
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}
# A regular sidecar never exits, so a Job with one never completes: batch pods always get
# the native form (an init container with restartPolicy: Always, Kubernetes >= 1.29).
RUN_TO_COMPLETION = {"Job", "CronJob"}

# kubectl's rule (k8s.io/apimachinery yaml.NewYAMLReader): a separator is a line that starts
# with "---" followed only by blanks or a comment.
_SEPARATOR = re.compile(r"^---[ \t]*(#.*)?\r?$")


class InjectError(Exception):
    """Bad input; the message says which document and what to fix."""


_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a container name


@dataclass(frozen=True)
class InjectOptions:
    image: str = DEFAULT_IMAGE
    configmap: str = DEFAULT_CONFIGMAP
    socket_dir: str = DEFAULT_SOCKET_DIR
    native: bool = False  # an init container with restartPolicy: Always
    openai_port: int | None = None  # the OpenAI HTTP front on 127.0.0.1:PORT; None = off

    @property
    def socket_path(self) -> str:
        return f"{self.socket_dir.rstrip('/')}/{SOCKET_FILE}"

    @property
    def socket_target(self) -> str:
        """The gRPC target apps dial: unix:///var/run/prefix-sidecar/sidecar.sock."""
        return f"unix://{self.socket_path}"

    @property
    def openai_listen(self) -> str:
        return f"127.0.0.1:{self.openai_port}"

    @property
    def openai_base_url(self) -> str:
        """What apps that opt in get as OPENAI_BASE_URL: http://127.0.0.1:PORT/v1."""
        return f"http://{self.openai_listen}/v1"

    def validate(self) -> None:
        if self.openai_port is not None:
            if not 1 <= self.openai_port <= 65535:
                raise InjectError(f"--openai-port {self.openai_port} is not a port (1..65535)")
            if self.openai_port == METRICS_PORT:
                raise InjectError(
                    f"--openai-port {self.openai_port} is the sidecar's metrics port; pick another"
                )
        if not self.image or any(c.isspace() for c in self.image):
            raise InjectError(f"--image {self.image!r} is not an image reference")
        if not _DNS1123_SUBDOMAIN.match(self.configmap):
            raise InjectError(
                f"--config {self.configmap!r} is not a valid ConfigMap name "
                "(lower-case letters, digits, '-' and '.')"
            )
        if not self.socket_dir.startswith("/") or self.socket_dir.rstrip("/") in ("", CONFIG_DIR):
            raise InjectError(
                f"--socket-dir {self.socket_dir!r} must be an absolute directory of its own"
            )


def sidecar_container(options: InjectOptions, native: bool) -> dict[str, Any]:
    """The container the manifests in deploy/k8s/ use too (a test keeps them in step)."""

    def probe(path: str, period_s: int, timeout_s: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": METRICS_PORT_NAME},
            "periodSeconds": period_s,
            "timeoutSeconds": timeout_s,
            "failureThreshold": failures,
        }

    # Flags win over the ConfigMap: the socket is always where --socket-dir says, and the
    # probes always find the metrics port on the pod IP, whatever the config file holds.
    metrics = ["--set", f"metrics_port={METRICS_PORT}", "--set", "metrics_host=0.0.0.0"]
    container: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "--config",
            f"{CONFIG_DIR}/{CONFIG_FILE}",
            *metrics,
            "--listen",
            options.socket_target,
        ],
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": SOCKET_VOLUME, "mountPath": options.socket_dir},
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
        ],
        # /readyz turns 200 once the first pods are warm (warm before serve, up to 5 minutes
        # on a cold fleet); liveness waits for startup. Later, /readyz is 503 while no pod
        # serves and while draining. An HTTP GET costs the sidecar well under a millisecond.
        "startupProbe": probe(READY_PATH, period_s=2, timeout_s=2, failures=150),
        "readinessProbe": probe(READY_PATH, period_s=5, timeout_s=2, failures=2),
        "livenessProbe": probe(LIVE_PATH, period_s=10, timeout_s=5, failures=3),
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"cpu": "1", "memory": "256Mi"},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if native:
        # Started before the app containers and stopped after them (KEP-753).
        container["restartPolicy"] = "Always"
    else:
        # All containers get SIGTERM together: keep routing while the app drains.
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    return container


# Which app containers get OPENAI_BASE_URL: every one, or those named.
OpenAIApps = Literal["all"] | tuple[str, ...]


def inject_pod_spec(
    spec: dict[str, Any],
    options: InjectOptions,
    native: bool,
    where: str,
    openai_apps: OpenAIApps = (),
    warnings: list[str] | None = None,
) -> None:
    """Ensure the sidecar, its volumes, and the socket mount + env of every app container;
    with options.openai_port, the sidecar's OpenAI front and OPENAI_BASE_URL in openai_apps."""
    volumes = _list_field(spec, "volumes", where)
    _ensure_named(volumes, {"name": SOCKET_VOLUME, "emptyDir": {}})
    _ensure_named(volumes, {"name": CONFIG_VOLUME, "configMap": {"name": options.configmap}})

    containers = _list_field(spec, "containers", where)
    init_containers = spec.get("initContainers") or []
    present = any(
        isinstance(c, dict) and c.get("name") == SIDECAR_NAME
        for c in [*containers, *init_containers]
    )
    if not present:
        if native:
            # First, so that later init containers can already reach the socket.
            _list_field(spec, "initContainers", where).insert(0, sidecar_container(options, True))
        else:
            containers.append(sidecar_container(options, False))

    for container in containers:
        if not isinstance(container, dict):
            raise InjectError(f"{where}: every entry of containers must be a mapping")
        if container.get("name") == SIDECAR_NAME:
            continue
        _mount_socket(container, options, where)
        env = _list_field(container, "env", where)
        if not any(isinstance(e, dict) and e.get("name") == SOCKET_ENV for e in env):
            env.append({"name": SOCKET_ENV, "value": options.socket_target})

    if options.openai_port is not None:
        _ensure_openai(spec, options, where, openai_apps, warnings if warnings is not None else [])

    # The socket is mode 0660: the app reaches it through the pod's fsGroup, which the
    # kubelet gives to the emptyDir (setgid) and to every container as a supplementary group.
    security = spec.setdefault("securityContext", {})
    if not isinstance(security, dict):
        raise InjectError(f"{where}: spec.securityContext must be a mapping")
    if "fsGroup" not in security:
        security["fsGroup"] = SIDECAR_UID
        security.setdefault("fsGroupChangePolicy", "OnRootMismatch")


def _ensure_openai(
    spec: dict[str, Any],
    options: InjectOptions,
    where: str,
    openai_apps: OpenAIApps,
    warnings: list[str],
) -> None:
    """The sidecar's --openai-listen 127.0.0.1:PORT, and OPENAI_BASE_URL in the apps that opt in."""
    every = [*spec["containers"], *(spec.get("initContainers") or [])]
    for container in every:
        if not isinstance(container, dict) or container.get("name") == SIDECAR_NAME:
            continue
        for port in container.get("ports") or []:
            if isinstance(port, dict) and port.get("containerPort") == options.openai_port:
                raise InjectError(
                    f"{where}: container {container.get('name')!r} declares containerPort "
                    f"{options.openai_port}, and the pod's containers share one network "
                    "namespace; pick another --openai-port"
                )
    sidecar = next(c for c in every if isinstance(c, dict) and c.get("name") == SIDECAR_NAME)
    args = _list_field(sidecar, "args", where)
    current = _flag_value(args, OPENAI_FLAG)
    if current is None:
        args.extend([OPENAI_FLAG, options.openai_listen])
    elif current != options.openai_listen:
        raise InjectError(
            f"{where}: the {SIDECAR_NAME} container already has {OPENAI_FLAG} {current}, "
            f"not {options.openai_listen}; fix it or pass the --openai-port it uses"
        )

    apps = {c.get("name"): c for c in spec["containers"] if c.get("name") != SIDECAR_NAME}
    if openai_apps == "all":
        chosen = list(apps.values())
    else:
        unknown = [name for name in openai_apps if name not in apps]
        if unknown:
            raise InjectError(
                f"{where}: annotation {OPENAI_ANNOTATION} names {', '.join(unknown)}, "
                f"not an app container of the pod ({', '.join(map(str, apps)) or 'none'})"
            )
        chosen = [apps[name] for name in openai_apps]
    for container in chosen:
        env = _list_field(container, "env", where)
        own = [e for e in env if isinstance(e, dict) and e.get("name") == OPENAI_ENV]
        if not own:
            env.append({"name": OPENAI_ENV, "value": options.openai_base_url})
        elif own[0] != {"name": OPENAI_ENV, "value": options.openai_base_url}:
            # Its value is not repeated: a URL may carry credentials.
            warnings.append(
                f"{where}: container {container.get('name')!r} keeps its own {OPENAI_ENV}; "
                "it is not pointed at the sidecar's OpenAI front"
            )


def _flag_value(args: list[Any], flag: str) -> str | None:
    """The value of `flag V` or `flag=V` in a container's args, the last one winning."""
    value = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = str(args[index + 1])
        elif isinstance(arg, str) and arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def _mount_socket(container: dict[str, Any], options: InjectOptions, where: str) -> None:
    mounts = _list_field(container, "volumeMounts", where)
    for mount in mounts:
        if not isinstance(mount, dict):
            raise InjectError(f"{where}: volumeMounts entries must be mappings")
        if mount.get("name") == SOCKET_VOLUME:
            return
        if str(mount.get("mountPath", "")).rstrip("/") == options.socket_dir.rstrip("/"):
            raise InjectError(
                f"{where}: container {container.get('name')!r} already mounts volume "
                f"{mount.get('name')!r} at {options.socket_dir}; pick another --socket-dir"
            )
    mounts.append({"name": SOCKET_VOLUME, "mountPath": options.socket_dir})


def _list_field(holder: dict[str, Any], key: str, where: str) -> list[Any]:
    value = holder.get(key)
    if value is None:
        value = holder[key] = []
    if not isinstance(value, list):
        raise InjectError(f"{where}: {key} must be a list, not {type(value).__name__}")
    return value


def _ensure_named(items: list[Any], wanted: dict[str, Any]) -> None:
    if not any(isinstance(item, dict) and item.get("name") == wanted["name"] for item in items):
        items.append(wanted)


@dataclass
class Chunk:
    """One document as it appeared in the input: its separator line and its body text."""

    separator: str
    body: str
    first_line: int  # 1-based line of the body in the input


@dataclass
class InjectResult:
    text: str
    injected: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (workload, why)
    warnings: list[str] = field(default_factory=list)  # what was asked for and not done


def split_documents(text: str) -> list[Chunk]:
    """Split into documents, keeping every character so that untouched ones round-trip."""
    chunks: list[Chunk] = []
    separator, first_line = "", 1
    body: list[str] = []
    # Split on "\n" only, like kubectl (str.splitlines would also split on U+2028 and co).
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    for number, line in enumerate(lines, start=1):
        if _SEPARATOR.match(line.rstrip("\n")):
            chunks.append(Chunk(separator, "".join(body), first_line))
            separator, body, first_line = line, [], number + 1
        else:
            body.append(line)
    chunks.append(Chunk(separator, "".join(body), first_line))
    # Text before the first separator is a document only if it says something.
    if len(chunks) > 1 and not chunks[0].separator and _is_blank(chunks[0].body):
        chunks[1].separator = chunks[0].body + chunks[1].separator
        chunks[1].first_line = chunks[0].first_line + chunks[0].body.count("\n") + 1
        del chunks[0]
    return chunks


def _is_blank(body: str) -> bool:
    return all(not line.strip() or line.lstrip().startswith("#") for line in body.splitlines())


def inject_text(text: str, options: InjectOptions) -> InjectResult:
    """Inject every workload in a multi-document YAML text; other documents stay as they are."""
    result = InjectResult(text="")
    out: list[str] = []
    for number, chunk in enumerate(split_documents(text), start=1):
        where = f"document {number} (line {chunk.first_line})"
        try:
            obj = yaml.safe_load(chunk.body)
        except yaml.YAMLError as exc:
            raise InjectError(f"{where}: malformed YAML: {_yaml_reason(exc, chunk)}") from exc
        if obj is None:  # empty document or comments only
            out.append(chunk.separator + chunk.body)
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
            raise InjectError(
                f"{where}: not a Kubernetes object; every document needs a mapping "
                "with apiVersion and kind"
            )
        updated = copy.deepcopy(obj)
        try:
            _inject_object(updated, options, result)
        except InjectError as exc:
            raise InjectError(f"{where}: {exc}") from None
        if updated == obj:
            out.append(chunk.separator + chunk.body)
        else:
            out.append(chunk.separator + _dump(updated))
    result.text = "".join(out)
    return result


def _inject_object(obj: dict[str, Any], options: InjectOptions, result: InjectResult) -> None:
    kind = obj["kind"]
    if kind == "List" or (kind.endswith("List") and "items" in obj):
        items = obj.get("items") or []
        if not isinstance(items, list):
            raise InjectError(f"{kind}.items must be a list")
        for index, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("kind"), str):
                raise InjectError(f"{kind}.items[{index}] is not a Kubernetes object")
            _inject_object(item, options, result)
        return
    if kind not in TEMPLATE_PATHS:
        return
    label = f"{kind.lower()}/{(obj.get('metadata') or {}).get('name', '<unnamed>')}"
    template = _walk(obj, TEMPLATE_PATHS[kind], label)
    spec = template.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("containers"), list):
        path = ".".join((*TEMPLATE_PATHS[kind], "spec", "containers"))
        raise InjectError(f"{label} has no {path} list; is the manifest complete?")
    if _opted_out(obj, label) or (template is not obj and _opted_out(template, label)):
        result.skipped.append((label, f"annotation {OPT_OUT_ANNOTATION}: false"))
        return
    native = options.native or kind in RUN_TO_COMPLETION
    openai_apps = _openai_apps(template, label)
    if openai_apps is None and template is not obj:
        openai_apps = _openai_apps(obj, label)
    if openai_apps and options.openai_port is None:
        result.warnings.append(
            f"{label}: annotation {OPENAI_ANNOTATION} asks for {OPENAI_ENV}, but there is no "
            "--openai-port: no OpenAI front, no env"
        )
    before = copy.deepcopy(spec)
    inject_pod_spec(
        spec,
        options,
        native=native,
        where=label,
        openai_apps=openai_apps or (),
        warnings=result.warnings,
    )
    if spec == before:
        result.skipped.append((label, "already injected"))
    else:
        result.injected.append(label + (" (native sidecar)" if native else ""))


def _walk(obj: dict[str, Any], path: tuple[str, ...], label: str) -> dict[str, Any]:
    node: Any = obj
    for depth, key in enumerate(path):
        node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise InjectError(f"{label} has no {'.'.join(path[: depth + 1])} mapping")
    result: dict[str, Any] = node
    return result


def _opted_out(holder: dict[str, Any], label: str) -> bool:
    annotations = (holder.get("metadata") or {}).get("annotations") or {}
    if OPT_OUT_ANNOTATION not in annotations:
        return False
    value = str(annotations[OPT_OUT_ANNOTATION]).strip().lower()
    if value in ("false", "disabled"):
        return True
    if value in ("true", "enabled"):
        return False
    raise InjectError(
        f'{label}: annotation {OPT_OUT_ANNOTATION}: "{annotations[OPT_OUT_ANNOTATION]}" '
        'is not understood; use "false" to opt out or "true" to inject'
    )


def _openai_apps(holder: dict[str, Any], label: str) -> OpenAIApps | None:
    """The opt-in annotation: "true" = every app container, "false" = none, else names."""
    annotations = (holder.get("metadata") or {}).get("annotations") or {}
    if OPENAI_ANNOTATION not in annotations:
        return None
    text = str(annotations[OPENAI_ANNOTATION]).strip()
    if text.lower() in ("true", "enabled"):
        return "all"
    if text.lower() in ("false", "disabled"):
        return ()
    names = tuple(name.strip() for name in text.split(","))
    if not all(_DNS1123_LABEL.match(name) for name in names):
        raise InjectError(
            f'{label}: annotation {OPENAI_ANNOTATION}: "{annotations[OPENAI_ANNOTATION]}" '
            'is not understood; use "true" for every app container, or container names '
            'separated by commas ("api,worker")'
        )
    return names


def _yaml_reason(exc: yaml.YAMLError, chunk: Chunk) -> str:
    """The parser's reason, with the line numbers of the whole file, not of the chunk."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        line = chunk.first_line + mark.line
        problem = exc.problem or "cannot parse"
        context = f" ({exc.context})" if exc.context else ""
        return f"{problem}{context} at line {line}, column {mark.column + 1}"
    return str(exc).replace("\n", " ")


class _ManifestDumper(yaml.SafeDumper):
    """Block style, no anchors; multi-line strings (scripts, configs) as `|` literals."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _represent_str)


def _dump(obj: dict[str, Any]) -> str:
    return yaml.dump(
        obj, Dumper=_ManifestDumper, sort_keys=False, default_flow_style=False, allow_unicode=True
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inject",
        help="add the sidecar to Kubernetes workloads in a YAML file",
        description=(
            "Add the prefix-sidecar container, its unix-socket volume and its config mount to "
            "every Deployment, StatefulSet, DaemonSet, ReplicaSet, Job, CronJob and Pod; write "
            "the manifests to stdout. Idempotent. Opt a workload out with the annotation "
            f'{OPT_OUT_ANNOTATION}: "false". Example: '
            "prefix-sidecar inject -f app.yaml | kubectl apply -f -"
        ),
    )
    parser.add_argument("-f", "--filename", required=True, help="manifest file, or - for stdin")
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIGMAP,
        help=f"ConfigMap with sidecar.yaml and the prefix files ({DEFAULT_CONFIGMAP})",
    )
    parser.add_argument("--image", default=DEFAULT_IMAGE, help=f"sidecar image ({DEFAULT_IMAGE})")
    parser.add_argument(
        "--socket-dir",
        default=DEFAULT_SOCKET_DIR,
        help=f"where the shared socket volume is mounted ({DEFAULT_SOCKET_DIR})",
    )
    parser.add_argument(
        "--native-sidecar",
        action="store_true",
        help="inject as an init container with restartPolicy: Always (Kubernetes >= 1.29); "
        "always done for Jobs and CronJobs",
    )
    parser.add_argument(
        "--openai-port",
        type=int,
        metavar="PORT",
        help="also serve the OpenAI HTTP front on the pod's 127.0.0.1:PORT; app containers "
        f'opted in with the annotation {OPENAI_ANNOTATION}: "true" (or "name,name") get '
        f"{OPENAI_ENV}=http://127.0.0.1:PORT/v1 (off)",
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no summary on stderr (warnings still)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        options = InjectOptions(
            image=args.image,
            configmap=args.config,
            socket_dir=args.socket_dir,
            native=args.native_sidecar,
            openai_port=args.openai_port,
        )
        options.validate()
        text = _read(args.filename)
        result = inject_text(text, options)
    except InjectError as exc:
        source = "<stdin>" if args.filename == "-" else args.filename
        print(f"prefix-sidecar inject: error: {source}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(result.text)
    sys.stdout.flush()
    for warning in result.warnings:
        print(f"prefix-sidecar inject: warning: {warning}", file=sys.stderr)
    if not args.quiet:
        for label in result.injected:
            print(f"{label} injected", file=sys.stderr)
        for label, why in result.skipped:
            print(f"{label} skipped ({why})", file=sys.stderr)
    return 0


def _read(filename: str) -> str:
    try:
        if filename == "-":
            return sys.stdin.read()
        with open(filename, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InjectError(f"cannot read the manifest: {exc}") from None
