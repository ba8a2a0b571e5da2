"""Run every attack scenario against one real `prefix-sidecar serve` process and judge it.

The sidecar is a `SidecarProcess` child (prefix_sidecar_tools/harness.py) whose backends come from
a file, so a scenario can add a hostile pod and take it away again. A healthy emulator pod is
always a member. Each attack runs in its own process (`python -m
prefix_sidecar_tools.attack.abuse`), so its CPU never delays the probe, which is another caller in
this process: a Route and a small Complete, both routed to the healthy pod, every 50 ms. RSS and
fds of the sidecar's pid come from /proc every 100 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefix_sidecar_tools.attack.pods import RAW_MODES
from prefix_sidecar_tools.bench.soak import MB, fd_count, rss_bytes
from prefix_sidecar_tools.emulator.fleet import start_emulator_blocking
from prefix_sidecar_tools.harness import (
    SERVE,
    SidecarProcess,
    free_port,
    python_command,
    spawn,
    spawn_blocking,
    terminate,
    terminate_blocking,
)
from prefix_sidecar_tools.percentile import percentile

RSS_BUDGET_MB = 200.0
PROBE_P50_MS = 100.0
PROBE_MAX_MS = 1000.0
FD_SLACK = 8  # pod connections in the pool come and go
# Memory "comes back": within this of the RSS before the attack, once the sidecar's periodic
# malloc_trim (prefix_sidecar/server/common/memory.py, every 10 s) has run.
RSS_BACK_SLACK_MB = 48.0
RSS_BACK_WAIT_S = 13.0
# A rapid reset fills grpc core's bounded pending queue with dead calls faster than Python
# takes them, and core sheds what waits there over 1 s - the probe's calls too. Shedding is
# the bound working; the probe must still get most answers, fast: at most this share of its
# calls during the attack shed (it was 0.5 of the answered count, i.e. a third of the calls,
# which a busy 2-core box crossed: 5 shed of 13).
SHED_PROBE_SHARE = 0.5
MESSAGE_LIMIT = 8 * 1024 * 1024  # max_message_bytes (the default); the huge event is 2x
# A body at the limit may not hold the loop (issue 27, defect 2): another caller's slowest
# call during it, where one such body held the loop 0.84-1.0 s before.
STALL_PROBE_MAX_MS = 250.0
# What an HTTP caller's scenario may add to the sidecar's log (asyncio wrote a traceback per
# failed accept: 266 MB in ~110 s at nofile 1,024).
LOG_GROWTH_BYTES = 64 * 1024
# `--sidecar-nofile`: the fresh sidecar starts under this RLIMIT_NOFILE (systemd's default
# soft limit is 1,024), the way issue 27 found the HTTP front without a connection cap.
NOFILE_LAUNCHER = (
    "import os, resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'prefix_sidecar.cli', *sys.argv[3:]])\n"
)
# The pods that break HTTP (issue 27), all members at once, and the callers sent to each.
BROKEN_MODES = tuple(mode for mode in RAW_MODES if mode != "good")
BROKEN_CALLERS = 6  # in a row, so a kept-alive connection carries the next caller's request


@dataclass
class Scenario:
    name: str
    kind: str  # "socket", "pod", "broken_pods" (every RAW_MODES pod at once) or "http"
    # an abuse.py attack, "stream_callers" against a hostile pod, pod_callers, or an
    # http_callers.py attack (the HTTP front's hostile callers)
    attack: str
    options: dict[str, Any]
    pod: str = ""  # the hostile pod's mode
    expect: str = ""  # what else must hold, checked in `_extra_checks`
    sheds: bool = False  # grpc core may shed some probe calls during the attack


def scenarios(short: bool) -> list[Scenario]:
    """The socket-level abuse and the misbehaving pods of issue 11, and the pods that break
    HTTP of issue 27; `short` is the CI size."""
    secs = 3.0 if short else 15.0
    return [
        Scenario("garbage", "socket", "garbage", {"connections": 20 if short else 200}),
        Scenario("http1", "socket", "http1", {"connections": 20 if short else 200}),
        Scenario(
            "rapid_reset",
            "socket",
            "rapid_reset",
            {
                "streams_per_connection": 20_000,
                "rounds": 3 if short else 10,
                "connections_per_round": 1,
                "deadline_s": 20.0 if short else 120.0,
            },
            sheds=True,
        ),
        Scenario(
            "continuation_flood",
            "socket",
            "continuation_flood",
            {"connections": 4 if short else 32, "deadline_s": secs},
        ),
        Scenario(
            "idle_connections",
            "socket",
            "idle_connections",
            {"connections": 200 if short else 2000, "hold_s": secs},
        ),
        Scenario("fast_stream", "pod", "stream_callers", {"count": 8, "seconds": secs}, "fast"),
        Scenario(
            "huge_event", "pod", "stream_callers", {"count": 2, "seconds": secs}, "huge", "ok"
        ),
        Scenario(
            "no_newline",
            "pod",
            "stream_callers",
            {"count": 2, "seconds": secs},
            "nonewline",
            "no_hang",
        ),
        Scenario(
            "redirect",
            "pod",
            "stream_callers",
            {"count": 4, "seconds": secs},
            "redirect",
            "no_recorder_hits",
        ),
        Scenario("wedge", "pod", "stream_callers", {"count": 4, "seconds": secs}, "wedge"),
        Scenario(
            "broken_pods",
            "broken_pods",
            "pod_callers",
            {"count": 2 if short else BROKEN_CALLERS},
            expect="own_answers",
        ),
        *http_scenarios(short),
    ]


def http_scenarios(short: bool) -> list[Scenario]:
    """Issue 27's caller-side defects of the HTTP front (2, 3, 4, 7)."""
    count = 1 if short else 3
    return [
        Scenario("large_body_tokens", "http", "large_body", {"shape": "tokens", "count": count},
                 expect="no_stall"),
        Scenario("large_body_messages", "http", "large_body",
                 {"shape": "messages", "count": count}, expect="no_stall"),
        Scenario("tiny_chunks", "http", "tiny_chunks", {"chunk": 2}, expect="http_413"),
        Scenario("many_connections", "http", "many_connections",
                 {"connections": 300 if short else 5000, "hold_s": 3.0 if short else 10.0},
                 expect="capped"),
        Scenario("deep_json", "http", "deep_json", {"count": 6 if short else 40},
                 expect="http_400"),
    ]  # fmt: skip


# --- the probe and the sampler -----------------------------------------------------------------


@dataclass
class Probe:
    prompt: str = ""  # routed to the healthy pod under the current membership
    latencies: list[float] = field(default_factory=list)  # every call, answered or not
    errors: list[str] = field(default_factory=list)
    answered: list[float] = field(default_factory=list)  # the calls that succeeded
    # Cleared while the membership changes: a call sent then with the old prompt could land on
    # the hostile pod (a fast pod never ends its stream) and stall the probe for its timeout.
    running: asyncio.Event = field(default_factory=asyncio.Event)
    # Route only (the sidecar alone): while a hostile HTTP caller's body reaches the healthy
    # pod, a Complete would time the pod's own parsing of it, not the sidecar's loop.
    route_only: bool = False

    def reset(self) -> tuple[list[float], list[str]]:
        taken = self.latencies, self.errors
        self.latencies, self.errors, self.answered = [], [], []
        return taken


async def _probe(stub: Any, probe: Probe, every_s: float = 0.05) -> None:
    import grpc

    from prefix_sidecar.v1 import router_pb2

    turn = 0
    while True:
        await probe.running.wait()
        started = time.perf_counter()
        try:
            if turn % 2 == 0 or probe.route_only:
                await stub.Route(router_pb2.RouteRequest(prompt=probe.prompt), timeout=5)
            else:
                request = router_pb2.CompleteRequest(input=probe.prompt, max_tokens=2)
                async for _chunk in stub.Complete(request, timeout=5):
                    pass
            probe.latencies.append(time.perf_counter() - started)
            probe.answered.append(probe.latencies[-1])
        except grpc.aio.AioRpcError as exc:
            probe.errors.append(exc.code().name)
            probe.latencies.append(time.perf_counter() - started)
        turn += 1
        await asyncio.sleep(every_s)


async def _sample_peak(pid: int, peak: list[int]) -> None:
    while True:
        with contextlib.suppress(OSError):
            peak[0] = max(peak[0], rss_bytes(pid))
        await asyncio.sleep(0.1)


def _stats(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {"p50_ms": float("nan"), "max_ms": float("nan"), "n": 0}
    return {
        "p50_ms": round(percentile(latencies, 50) * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1),
        "n": len(latencies),
    }


# --- the run ----------------------------------------------------------------------------------


async def _run_attack(name: str, socket_path: str, options: dict[str, Any]) -> dict[str, Any]:
    if name == "pod_callers":
        argv = ["prefix_sidecar_tools.attack.pod_callers", socket_path]
    elif not socket_path:  # an HTTP front's caller: its address is in the options
        argv = ["prefix_sidecar_tools.attack.http_callers", name]
    else:
        argv = ["prefix_sidecar_tools.attack.abuse", name, socket_path]
    process = await spawn(
        python_command("-m", *argv, json.dumps(options)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), 300)
    except TimeoutError:
        await terminate(process, 0)
        return {"errors": ["the attack process did not stop within 300 s"]}
    if process.returncode != 0:
        return {"errors": [f"attack process exit {process.returncode}: {err.decode()[-500:]}"]}
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


class Harness:
    """The healthy pod, the hostile pods, the sidecar and the probe's channel."""

    def __init__(self, workdir: str, nofile: tuple[int, int] | None = None) -> None:
        self.workdir = workdir
        self.nofile = nofile
        self.backends_file = os.path.join(workdir, "backends.json")
        self.processes: list[subprocess.Popen[Any]] = []
        self.pods: dict[str, str] = {}
        self.healthy = ""
        self.sidecar: SidecarProcess | None = None
        self.http_url = ""  # the sidecar's HTTP front
        self.metrics_url = ""

    def start_pods(self) -> None:
        self.healthy = start_emulator_blocking(self.processes, "--time-scale", "1000")
        hostile = spawn_blocking(
            python_command("-m", "prefix_sidecar_tools.attack.pods",
                           "--huge-bytes", str(2 * MESSAGE_LIMIT)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self.processes.append(hostile)
        assert hostile.stdout is not None
        while len(self.pods) < 6 + len(RAW_MODES):
            words = hostile.stdout.readline().decode().split()
            if len(words) != 3 or words[0] != "READY":
                raise RuntimeError(f"the hostile pods did not start (said {words!r})")
            self.pods[words[1]] = words[2]

    def set_members(self, urls: list[str]) -> None:
        tmp = self.backends_file + ".tmp"
        Path(tmp).write_text(json.dumps(urls), encoding="utf-8")
        os.replace(tmp, self.backends_file)  # atomic: the watcher never reads half a file

    async def start_sidecar(self) -> SidecarProcess:
        self.set_members([self.healthy])
        settings = {
            "file_interval_s": 0.2,
            "health_interval_s": 0.2,
            "first_token_timeout_s": 3,
            # broken_pods: a request may meet every broken pod before the healthy one.
            "max_attempts": len(RAW_MODES) + 1,
            "max_message_bytes": MESSAGE_LIMIT,
            "grace_s": 1,
            "log_level": "warning",
        }
        http_port, metrics_port = free_port(), free_port()
        self.http_url = f"http://127.0.0.1:{http_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        args = ["--backends-file", self.backends_file, "--openai-listen", f"127.0.0.1:{http_port}"]
        args += ["--set", f"metrics_port={metrics_port}", "--set", "metrics_host=127.0.0.1"]
        for key, value in settings.items():
            args += ["--set", f"{key}={value}"]
        launcher: tuple[str, ...] = SERVE
        if self.nofile is not None:
            launcher = ("-c", NOFILE_LAUNCHER, *map(str, self.nofile))
        self.sidecar = SidecarProcess(
            os.path.join(self.workdir, "s.sock"),
            args,
            log_path=os.path.join(self.workdir, "sidecar.log"),
            launcher=launcher,
        )
        await self.sidecar.start()
        return self.sidecar

    def close(self) -> None:
        for process in reversed(self.processes):
            terminate_blocking(process, 10)


async def _wait_members(stub: Any, urls: set[str], timeout: float = 15.0) -> None:
    from prefix_sidecar.v1 import router_pb2

    deadline = time.monotonic() + timeout
    while True:
        reply = await stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)
        states = {b.url: b.state for b in reply.backends}
        if set(states) == urls and all(s == "serving" for s in states.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"members not serving after {timeout} s: {states}")
        await asyncio.sleep(0.05)


async def prompt_routed_to(stub: Any, backend: str, tag: str) -> str:
    """A prompt that the sidecar routes to `backend` first (routing is deterministic)."""
    from prefix_sidecar.v1 import router_pb2

    for index in range(500):
        prompt = f"{tag} {index}: is 'lowest price ever' allowed in a 618 banner?"
        reply = await stub.Route(router_pb2.RouteRequest(prompt=prompt), timeout=5)
        if reply.backend == backend:
            return prompt
    raise RuntimeError(f"no prompt routes to {backend}")


async def run(
    short: bool,
    only: list[str] | None = None,
    progress: Any = print,
    nofile: tuple[int, int] | None = None,
) -> dict[str, Any]:
    import grpc

    from prefix_sidecar.v1 import router_pb2_grpc

    workdir = tempfile.mkdtemp(prefix="psattack-")
    harness = Harness(workdir, nofile)
    rows: list[dict[str, Any]] = []
    try:
        harness.start_pods()
        sidecar = await harness.start_sidecar()
        pid = sidecar.pid
        async with grpc.aio.insecure_channel(sidecar.target) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            await _wait_members(stub, {harness.healthy})
            probe = Probe(prompt=await prompt_routed_to(stub, harness.healthy, "probe"))
            probe.running.set()
            probing = asyncio.create_task(_probe(stub, probe))
            baseline_rss = rss_bytes(pid)
            for scenario in scenarios(short):
                if only and scenario.name not in only:
                    continue
                progress(f"scenario {scenario.name} ...")
                rows.append(await _scenario(scenario, harness, stub, pid, probe, baseline_rss))
                progress(_row_line(rows[-1]))
            probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probing
        alive = sidecar.process is not None and sidecar.process.returncode is None
        code = await sidecar.stop(grace=10)
    finally:
        if harness.sidecar is not None:
            await harness.sidecar.stop(grace=5)
        harness.close()
    passed = alive and code == 0 and all(row["passed"] for row in rows)
    return {
        "short": short,
        "thresholds": {
            "rss_over_baseline_mb": RSS_BUDGET_MB,
            "probe_p50_ms": PROBE_P50_MS,
            "probe_max_ms": PROBE_MAX_MS,
            "fd_slack": FD_SLACK,
        },
        "sidecar_exit_code": code,
        "sidecar_nofile": list(nofile) if nofile else None,
        "scenarios": rows,
        "passed": passed,
    }


async def _scenario(
    scenario: Scenario, harness: Harness, stub: Any, pid: int, probe: Probe, baseline: int
) -> dict[str, Any]:
    assert harness.sidecar is not None
    members = {harness.healthy}
    attack_options = dict(scenario.options)
    target = harness.sidecar.socket_path
    probe.route_only = scenario.kind == "http"
    if scenario.kind == "http":
        target = ""
        attack_options["http"] = harness.http_url.removeprefix("http://")
    if scenario.kind == "pod":
        hostile = harness.pods[scenario.pod]
        members.add(hostile)
        probe.running.clear()
        harness.set_members(sorted(members))
        await _wait_members(stub, members)
        attack_options["prompt"] = await prompt_routed_to(stub, hostile, scenario.name)
        # The probe measures another caller's latency: its key must stay on the healthy pod
        # now that the hostile one is a member too (pod ports, so ring places, vary by run).
        probe.prompt = await prompt_routed_to(stub, harness.healthy, f"probe-{scenario.name}")
        probe.running.set()
    if scenario.kind == "broken_pods":
        attack_options = await _broken_pods_in(harness, stub, probe, scenario.options["count"])
        members = {harness.healthy, *(harness.pods[mode] for mode in BROKEN_MODES)}
    hits_before = await _recorder_hits(harness.pods["recorder"])
    log_before = os.path.getsize(harness.sidecar.log_path)
    # before: 1 s of probing
    probe.reset()
    await asyncio.sleep(1.0)
    before_lat, before_err = probe.reset()
    rss_before, fds_before = rss_bytes(pid), fd_count(pid)
    peak = [rss_before]
    sampling = asyncio.create_task(_sample_peak(pid, peak))
    result = await _run_attack(scenario.attack, target, attack_options)
    answered = probe.answered
    during_lat, during_err = probe.reset()
    if scenario.kind == "broken_pods":
        result["failovers"] = await _failovers_by_mode(harness)
    if scenario.kind != "socket":
        harness.set_members([harness.healthy])
        with contextlib.suppress(RuntimeError):
            await _wait_members(stub, {harness.healthy})
    await asyncio.sleep(1.0)  # settle, then 1 s of probing after
    probe.reset()
    await asyncio.sleep(1.0)
    after_lat, after_err = probe.reset()
    sampling.cancel()
    rss_after, fds_after = rss_bytes(pid), fd_count(pid)
    rss_settled = await _settled_rss(pid, rss_before + RSS_BACK_SLACK_MB * MB)
    row: dict[str, Any] = {
        "scenario": scenario.name,
        "attack": result,
        "rss_mb": {
            "baseline": round(baseline / MB, 1),
            "before": round(rss_before / MB, 1),
            "peak": round(peak[0] / MB, 1),
            "after": round(rss_after / MB, 1),
            "settled": round(rss_settled / MB, 1),
        },
        "fds": {"before": fds_before, "after": fds_after},
        "probe": {
            "before": _stats(before_lat),
            "during": _stats(during_lat),
            "after": _stats(after_lat),
            "errors": {
                "before": sorted(set(before_err)),
                "during": sorted(set(during_err)),
                "after": sorted(set(after_err)),
                "during_count": len(during_err),
            },
        },
    }
    budget = baseline + RSS_BUDGET_MB * MB
    during = row["probe"]["during"]
    checks = {
        "rss_peak_within_budget": peak[0] <= budget,
        "rss_after_within_budget": rss_after <= budget,
        "rss_comes_back": rss_settled <= rss_before + RSS_BACK_SLACK_MB * MB,
        "fds_back": fds_after <= fds_before + FD_SLACK,
        "probe_during_p50": during["n"] > 0 and during["p50_ms"] <= PROBE_P50_MS,
        "probe_no_errors_before_after": not (before_err or after_err),
    }
    if scenario.sheds:
        shed_ok = {"CANCELLED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
        row["probe"]["shed"] = len(during_err)
        calls = len(during_err) + len(during_lat)  # the probe's calls during the attack
        checks["probe_mostly_answered"] = set(during_err) <= shed_ok and len(
            during_err
        ) <= SHED_PROBE_SHARE * max(calls, 1)
        checks["probe_answered_max"] = bool(answered) and max(answered) * 1000 <= PROBE_MAX_MS
    else:
        checks["probe_during_max"] = during["n"] > 0 and during["max_ms"] <= PROBE_MAX_MS
        checks["probe_no_errors_during"] = not during_err
    checks.update(await _extra_checks(scenario, result, harness, hits_before))
    if scenario.kind == "http":
        checks.update(http_checks(scenario, result, during, pid))
        log_growth = os.path.getsize(harness.sidecar.log_path) - log_before
        row["log_growth_bytes"] = log_growth
        checks["log_bounded"] = log_growth <= LOG_GROWTH_BYTES
    row["checks"] = checks
    row["passed"] = all(checks.values())
    return row


async def _broken_pods_in(harness: Harness, stub: Any, probe: Probe, count: int) -> dict[str, Any]:
    """Make every broken pod a member beside the healthy one; the pod_callers options: for
    each, `count` prompts that route to it first."""
    members = {harness.healthy, *(harness.pods[mode] for mode in BROKEN_MODES)}
    probe.running.clear()
    harness.set_members(sorted(members))
    await _wait_members(stub, members)
    prompts = {
        mode: [
            await prompt_routed_to(stub, harness.pods[mode], f"{mode} {n}") for n in range(count)
        ]
        for mode in BROKEN_MODES
    }
    probe.prompt = await prompt_routed_to(stub, harness.healthy, "probe-broken-pods")
    probe.running.set()
    pods = {mode: harness.pods[mode] for mode in BROKEN_MODES}
    return {"http_url": harness.http_url, "prompts": prompts, "pods": pods}


async def _failovers_by_mode(harness: Harness) -> dict[str, float]:
    """Each broken pod's failovers (both fronts, any reason), from the sidecar's /metrics."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(harness.metrics_url) as response:
        text = await response.text()
    modes = {url: mode for mode, url in harness.pods.items() if mode in BROKEN_MODES}
    found = dict.fromkeys(BROKEN_MODES, 0.0)
    for line in text.splitlines():
        if line.startswith("prefix_sidecar_failovers_total{"):
            backend = line.split('backend="', 1)[1].split('"', 1)[0]
            if backend in modes:
                found[modes[backend]] += float(line.rsplit(" ", 1)[1])
    return found


async def _settled_rss(pid: int, target: float, wait_s: float = RSS_BACK_WAIT_S) -> int:
    """The RSS once it is back under `target`, or after `wait_s` (freed memory is trimmed
    periodically, not at once)."""
    deadline = time.monotonic() + wait_s
    rss = rss_bytes(pid)
    while rss > target and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        rss = rss_bytes(pid)
    return rss


async def _recorder_hits(url: str) -> int:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(url + "/hits") as response:
        return int((await response.json())["hits"])


async def _extra_checks(
    scenario: Scenario, result: dict[str, Any], harness: Harness, hits_before: int
) -> dict[str, bool]:
    statuses = result.get("errors", [])
    if scenario.expect == "no_recorder_hits":
        hits = await _recorder_hits(harness.pods["recorder"]) - hits_before
        return {"redirect_not_followed": hits == 0}
    if scenario.expect == "ok":  # fails over before the first token, never a huge Chunk
        return {"callers_ok": bool(statuses) and all(s == "OK" for s in statuses)}
    if scenario.expect == "no_hang":
        return {"callers_ended": len(statuses) == scenario.options["count"]}
    if scenario.expect == "own_answers":  # every caller its own answer, from the healthy pod
        return {
            "no_caller_affected": result.get("affected") == 0,
            "no_broken_answer_accepted": result.get("accepted") == 0,
            "no_caller_failed": result.get("failed") == 0 and not result.get("errors"),
            # The unasked pod's first answer is right: only its connection goes.
            "every_broken_pod_failed_over": all(
                moved
                for mode, moved in result.get("failovers", {"": 0}).items()
                if mode != "unasked"
            ),
        }
    return {}


def http_checks(
    scenario: Scenario, result: dict[str, Any], during: dict[str, Any], pid: int | None
) -> dict[str, bool]:
    """What must hold of an HTTP front's hostile caller (issue 27), beyond the probe's."""
    statuses = result.get("statuses", {})
    if scenario.expect == "no_stall":
        relayed = all(s.startswith("HTTP ") and not s.startswith("HTTP 5") for s in statuses)
        return {
            "pod_answer_relayed": bool(statuses) and relayed,
            "probe_during_no_stall": during["n"] > 0 and during["max_ms"] <= STALL_PROBE_MAX_MS,
        }
    if scenario.expect in ("http_413", "http_400"):
        return {f"answered_{scenario.expect[5:]}": set(statuses) == {f"HTTP {scenario.expect[5:]}"}}
    if scenario.expect == "capped":
        from prefix_sidecar.server.common.connections import front_cap

        cap = front_cap(2, _soft_nofile(pid)) if pid is not None else result["connections"]
        over = result["connections"] - cap
        return {"over_cap_closed": result["closed_by_server"] >= over}
    return {}


def _soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    return 1024


async def run_against(
    url: str, short: bool, only: list[str] | None = None, progress: Any = print
) -> dict[str, Any]:
    """The HTTP front's hostile callers against a running `serve` (its --openai-listen
    URL): another caller's GET /health on the same front is the probe, every 50 ms."""
    import aiohttp

    http = url.removeprefix("http://").rstrip("/")
    rows: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        latencies: list[float] = []
        errors: list[str] = []

        limit = aiohttp.ClientTimeout(total=5)

        async def probe() -> None:
            while True:
                started = time.perf_counter()
                try:
                    async with session.get(f"http://{http}/health", timeout=limit) as reply:
                        await reply.read()
                        if reply.status >= 500 and reply.status != 503:
                            errors.append(f"HTTP {reply.status}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    errors.append(type(exc).__name__)
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.05)

        probing = asyncio.create_task(probe())
        try:
            for scenario in http_scenarios(short):
                if only and scenario.name not in only:
                    continue
                progress(f"scenario {scenario.name} against {url} ...")
                latencies.clear()
                errors.clear()
                result = await _run_attack(scenario.attack, "", {**scenario.options, "http": http})
                during = _stats(latencies)
                checks = http_checks(scenario, result, during, None)
                checks["probe_no_errors_during"] = not errors
                rows.append({"scenario": scenario.name, "attack": result, "checks": checks,
                             "probe": {"during": during, "errors": sorted(set(errors))},
                             "passed": all(checks.values())})  # fmt: skip
                progress(_row_line(rows[-1]))
        finally:
            probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probing
    return {"against": url, "short": short, "scenarios": rows,
            "passed": all(row["passed"] for row in rows)}  # fmt: skip


def _verdict(row: dict[str, Any]) -> str:
    """PASS, or FAIL: and the checks that failed, for a scenario's table row."""
    failed = [name for name, ok in row["checks"].items() if not ok]
    return "PASS" if row["passed"] else "FAIL: " + ", ".join(failed)


def _p50_max(stats: dict[str, Any]) -> str:
    return f"{stats['p50_ms']:g} / {stats['max_ms']:g}"


def render_against(report: dict[str, Any]) -> str:
    lines = [f"prefix-sidecar attack --against {report['against']}", "",
             "| scenario | statuses | wire MB | seconds | /health p50 / max ms during | verdict |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in report["scenarios"]:
        attack = row["attack"]
        lines.append(
            f"| {row['scenario']} | {attack.get('statuses', attack.get('errors'))} | "
            f"{attack.get('bytes_sent', 0) / MB:.1f} | {attack.get('seconds', 0):g} | "
            f"{_p50_max(row['probe']['during'])} | {_verdict(row)} |"
        )
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


# --- output -----------------------------------------------------------------------------------


def _row_line(row: dict[str, Any]) -> str:
    failed = [name for name, ok in row["checks"].items() if not ok]
    verdict = "PASS" if row["passed"] else "FAIL " + ",".join(failed)
    return f"  {row['scenario']}: {verdict}"


def render(report: dict[str, Any]) -> str:
    head = (
        "| scenario | RSS MB before / peak / after | fds before / after | probe p50/max ms "
        "before | during | after | probe errors | verdict |"
    )
    lines = [head, "|" + "---|" * 8]
    for row in report["scenarios"]:
        rss, fds, probe = row["rss_mb"], row["fds"], row["probe"]
        pm = _p50_max
        lines.append(
            f"| {row['scenario']} | {rss['before']:g} / {rss['peak']:g} / {rss['after']:g} | "
            f"{fds['before']} / {fds['after']} | {pm(probe['before'])} | {pm(probe['during'])} | "
            f"{pm(probe['after'])} | {probe['errors']['during_count']} | {_verdict(row)} |"
        )
    thresholds = report["thresholds"]
    lines.append(
        f"\nthresholds: RSS <= baseline + {thresholds['rss_over_baseline_mb']:g} MB (peak and "
        f"after), fds back within {thresholds['fd_slack']}, probe during p50 <= "
        f"{thresholds['probe_p50_ms']:g} ms and max <= {thresholds['probe_max_ms']:g} ms, no "
        f"probe errors (rapid reset: at most {SHED_PROBE_SHARE:.0%} of the probe's calls shed "
        f"by grpc core during it); RSS back within {RSS_BACK_SLACK_MB:g} MB of before; "
        f"sidecar exit code {report['sidecar_exit_code']}"
    )
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)
