"""`prefix-sidecar bench core`: the routing core against uhashring and docs/mission.md's router.

Everything is measured side by side in one run, because absolute times drift on shared
machines and only ratios from the same run mean something. A second part measures how the
extension's decision cost grows with the fleet (10 to 5,000 pods), for the ring and the Maglev
table (routing contract section 8), with the loads' total given as the sidecar's pool gives
it, and how many keys move when one pod of 100 leaves, Maglev against the ring.
Latencies are timeit-style: a pre-generated key list, the method bound to a local,
`for k in keys: f(k)` auto-ranged to a time budget, the median of several repeats. The loop
overhead is included in every number (it is the same for all, and it makes the ratios
conservative) and printed on its own.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import platform
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from prefix_sidecar import _core_py
from prefix_sidecar_tools.bench.baselines import (
    MD5_SPACE,
    LoadCheckedPick,
    NoteRouter,
    UhashringRouter,
    exact_shares,
)
from prefix_sidecar_tools.bench.core_organic import organic_decisions, render_organic
from prefix_sidecar_tools.report import (
    add_command,
    add_json_option,
    progress_printer,
    run_and_report,
    target_lines,
)

IMPLEMENTATIONS = ("cython", "python", "uhashring", "note")
BASELINES = ("uhashring", "note")
TARGETS = {"owner": 20.0, "pick": 10.0}  # at 100 pods: baseline ns / cython ns
TARGET_PODS = 100
SCALE_PODS = (10, 100, 1000, 5000)
SCALE_TABLES = ("ring", "maglev")
SCALE_TARGET = 1.5  # pick at the most pods / pick at the fewest, each table
CHURN_PODS = 100
ROUTER_PODS = 100
SCALE_ROUNDS = 9  # interleaved rounds of the scaling part; each number is its fastest round
PROMPT_BYTES = 240 * 1024
DEFINITIONS = {
    "owner": "cython/python: ring.owner(int key); uhashring/note: get_node(64-char SHA-256 hex "
    "fingerprint), which hashes the string with MD5 and bisects - their only lookup API",
    "pick": "cython/python: ring.pick(key, array('q') loads), replicas=1, factor=1.25 (load sum, "
    "cap, spill walk); uhashring/note: get_node + cap check at the owner + least-loaded scan on "
    "overflow (LoadCheckedPick: less work than the core's pick)",
    "route": "apples to apples from a short key: cython/python owner(route_key(bytes)); "
    "uhashring/note get_node(the same key as str)",
    "moved_pct": "measured: % of sampled keys whose owner changed when pod N//2 left; "
    "stray = keys that moved between two surviving pods (must be 0)",
    "scaling": "cython only, fastest of interleaved rounds in thread CPU time, random keys "
    "and loads 0..7: "
    "owner(key); pick = pick(key, loads, "
    "1, 1.25, 0, total) with the loads' total given (the sidecar's path: the pool keeps it); "
    "pick summed = the same pick without the total (it sums N loads); pick_bytes = key of "
    "a 40-byte prompt head + pick in one call",
    "router": "Router.for_prompt of an unregistered prompt (prefix match, window, pick, "
    "failover list) through the one-call path or route_key + Pick + policy.select",
    "churn": "one pod of 100 leaves: % of sampled keys whose owner changed (ideal = its "
    "share); stray = keys that moved between two surviving pods (ring: 0; Maglev: a few)",
}


class Timer:
    """Median ns per call of a loop over `calls` items, auto-ranged to `budget_s` per repeat."""

    def __init__(
        self, budget_s: float, repeats: int, clock: Callable[[], int] = time.perf_counter_ns
    ) -> None:
        self.budget_s = budget_s
        self.repeats = repeats
        self.clock = clock

    def ns_per_call(self, loop: Callable[[int], None], calls: int) -> float:
        number = 1
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            while True:
                elapsed = self._run(loop, number)
                if elapsed >= self.budget_s * 1e9 or number >= 1 << 20:
                    break
                number *= max(2, min(10, int(self.budget_s * 1e9 / max(elapsed, 1)) + 1))
            samples = [elapsed] + [self._run(loop, number) for _ in range(self.repeats - 1)]
        finally:
            if gc_was_enabled:
                gc.enable()
        return statistics.median(samples) / (number * calls)

    def _run(self, loop: Callable[[int], None], number: int) -> int:
        clock = self.clock
        start = clock()
        loop(number)
        return clock() - start


def _loop1(func: Callable[[Any], Any], items: Sequence[Any]) -> Callable[[int], None]:
    def loop(number: int) -> None:
        for _ in range(number):
            for item in items:
                func(item)

    return loop


def _loop_pick(
    func: Callable[[Any, Any], Any], items: Sequence[Any], loads: Any
) -> Callable[[int], None]:
    def loop(number: int) -> None:
        for _ in range(number):
            for item in items:
                func(item, loads)

    return loop


def _loop_route(
    hash_key: Callable[[bytes], int], owner: Callable[[int], str], items: Sequence[bytes]
) -> Callable[[int], None]:
    def loop(number: int) -> None:
        for _ in range(number):
            for item in items:
                owner(hash_key(item))

    return loop


def _loop_empty(items: Sequence[Any]) -> Callable[[int], None]:
    def loop(number: int) -> None:
        for _ in range(number):
            for _item in items:
                pass

    return loop


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
    }


def pod_names(count: int) -> list[str]:
    return [f"http://10.0.{i // 250}.{i % 250 + 2}:8000" for i in range(count)]


def _build_subject(impl: str, core: Any, pods: Sequence[str]) -> Any:
    if impl in ("cython", "python"):
        return core.Ring(pods)
    if impl == "uhashring":
        return UhashringRouter(pods)
    return NoteRouter(pods)


def _build_ms(impl: str, core: Any, pods: Sequence[str], quick: bool) -> tuple[float, Any]:
    """Median build time (ms) of up to 3 builds, stopping early once 2 s are spent."""
    samples: list[float] = []
    subject = None
    spent = 0.0
    while len(samples) < (1 if quick else 3) and spent < 2.0:
        start = time.perf_counter()
        subject = _build_subject(impl, core, pods)
        elapsed = time.perf_counter() - start
        samples.append(elapsed * 1e3)
        spent += elapsed
    return statistics.median(samples), subject


def ring_quality(
    impl: str, core: Any, subject: Any, pods: Sequence[str], sample_keys: int, rng: random.Random
) -> dict[str, Any]:
    if impl in ("cython", "python"):
        shares = subject.shares()
        point_count = len(subject.points())
        lookup: Callable[[Any], str] = subject.owner
        keys: list[Any] = [rng.getrandbits(64) for _ in range(sample_keys)]
    else:
        points = subject.points()
        shares = exact_shares(points, MD5_SPACE)
        point_count = len(points)
        lookup = subject.get_node
        keys = [f"{rng.getrandbits(64):016x}" for _ in range(sample_keys)]
    leaving = pods[len(pods) // 2]
    survivors = [pod for pod in pods if pod != leaving]
    after = _build_subject(impl, core, survivors)
    after_lookup = after.owner if impl in ("cython", "python") else after.get_node
    moved = stray = 0
    for key in keys:
        before_owner, after_owner = lookup(key), after_lookup(key)
        if before_owner != after_owner:
            moved += 1
            stray += before_owner != leaving
    return {
        "points": point_count,
        "busiest_over_mean": max(shares.values()) * len(pods),
        "moved_pct": 100.0 * moved / len(keys),
        "leaving_share_pct": 100.0 * shares.get(leaving, 0.0),
        "ideal_pct": 100.0 / len(pods),
        "stray_moves": stray,
    }


def latencies(
    impl: str, subject: Any, core: Any, pods: Sequence[str], timer: Timer, count: int, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    short_keys = [f"tenant-{rng.randrange(10**6)}:promo-rules-v7" for _ in range(count)]
    loads_list = [rng.randrange(0, 8) for _ in pods]
    if impl in ("cython", "python"):
        int_keys = [rng.getrandbits(64) for _ in range(count)]
        owner, pick = subject.owner, subject.pick
        encoded = [key.encode() for key in short_keys]
        return {
            "owner": timer.ns_per_call(_loop1(owner, int_keys), count),
            "pick": timer.ns_per_call(_loop_pick(pick, int_keys, array("q", loads_list)), count),
            "route": timer.ns_per_call(_loop_route(core.route_key, owner, encoded), count),
        }
    fingerprints = [hashlib.sha256(rng.randbytes(32)).hexdigest() for _ in range(count)]
    get_node = subject.get_node
    checked = LoadCheckedPick(get_node, pods).pick
    return {
        "owner": timer.ns_per_call(_loop1(get_node, fingerprints), count),
        "pick": timer.ns_per_call(_loop_pick(checked, fingerprints, loads_list), count),
        "route": timer.ns_per_call(_loop1(get_node, short_keys), count),
    }


def throughput(c_core: Any, timer: Timer) -> dict[str, float]:
    """MB/s of hashing one fat prompt (PROMPT_BYTES of UTF-8 text)."""
    line = "Rule 17: no absolute claims such as 'lowest price ever'. 第十七条：禁止绝对化用语。\n"
    text = (line * (PROMPT_BYTES // len(line.encode()) + 1)).encode()[:PROMPT_BYTES]
    prompt_text = text.decode("utf-8", errors="ignore")
    prompt = prompt_text.encode()
    subjects: dict[str, tuple[Callable[[Any], Any], Any]] = {
        "route_key cython": (c_core.route_key, prompt),
        "route_key python": (_core_py.route_key, prompt),
        "prefix_id cython": (c_core.prefix_id, prompt_text),
        "prefix_id python": (_core_py.prefix_id, prompt_text),
        "hashlib.md5 (reference)": (lambda data: hashlib.md5(data).digest(), prompt),
        "hashlib.sha256 (reference)": (lambda data: hashlib.sha256(data).digest(), prompt),
    }
    result = {}
    for name, (func, data) in subjects.items():
        ns = timer.ns_per_call(_loop1(func, [data]), 1)
        result[name] = len(prompt) / 1e6 / (ns / 1e9)
    return result


def _loop_pick_total(
    func: Callable[..., Any], items: Sequence[Any], loads: Any, total: int
) -> Callable[[int], None]:
    def loop(number: int) -> None:
        for _ in range(number):
            for item in items:
                func(item, loads, 1, 1.25, 0, total)

    return loop


def scaling(
    c_core: Any,
    pod_counts: Sequence[int],
    timer: Timer,
    count: int,
    seed: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """ns per call of owner and pick as the fleet grows, for each table, and the ratio of
    the most pods' pick to the fewest's.

    The machine is shared, so one measurement can land in a burst of someone else's work and
    a ratio of two of them means little. Every (pods, table, op) is measured once per round,
    rounds interleave them all, and each keeps its fastest round (timeit's advice: the
    minimum is the run least disturbed). The clock is this thread's CPU time: time the
    scheduler gives to other processes is not counted (their cache traffic still is)."""
    ops = ("owner", "pick", "pick_summed", "pick_bytes")
    loops: dict[tuple[str, str, str], Callable[[int], None]] = {}
    tables = []  # kept alive for the whole measurement
    for pods_count in pod_counts:
        pods = pod_names(pods_count)
        rng = random.Random(seed)
        keys = [rng.getrandbits(64) for _ in range(count)]
        heads = [rng.randbytes(40) for _ in range(count)]
        loads = array("q", [rng.randrange(0, 8) for _ in pods])
        total = sum(loads)
        for kind in SCALE_TABLES:
            progress(f"scaling: building the {kind} of {pods_count} pods")
            table = c_core.make_table(kind, pods, None, c_core.DEFAULT_VNODES)
            tables.append(table)
            at = str(pods_count)
            loops[at, kind, "owner"] = _loop1(table.owner, keys)
            loops[at, kind, "pick"] = _loop_pick_total(table.pick, keys, loads, total)
            loops[at, kind, "pick_summed"] = _loop_pick(table.pick, keys, loads)
            loops[at, kind, "pick_bytes"] = _loop_pick_total(table.pick_bytes, heads, loads, total)
    once = Timer(timer.budget_s / 2, 1, time.thread_time_ns)
    best: dict[tuple[str, str, str], float] = {}
    for round_ in range(SCALE_ROUNDS if timer.repeats > 3 else 3):
        progress(f"scaling: round {round_ + 1}")
        for name, loop in loops.items():
            ns = once.ns_per_call(loop, count)
            best[name] = min(ns, best.get(name, ns))
    latency = {
        str(n): {kind: {op: best[str(n), kind, op] for op in ops} for kind in SCALE_TABLES}
        for n in pod_counts
    }
    few, most = str(min(pod_counts)), str(max(pod_counts))
    ratios = {
        kind: {op: latency[most][kind][op] / latency[few][kind][op] for op in ops}
        for kind in SCALE_TABLES
    }
    return {"pods": list(pod_counts), "latency_ns": latency, "ratio_most_over_fewest": ratios}


class _SelectOnly:
    """A policy without the one-call path: the router falls back to key + Pick + select."""

    def __init__(self, policy: Any) -> None:
        self.select = policy.select


def router_paths(count: int, timer: Timer, seed: int) -> dict[str, float]:
    """Router.for_prompt for unregistered prompts at ROUTER_PODS pods: the one-call path
    (pick_bytes) against route_key + Pick + policy.select; same pool, interleaved rounds,
    thread CPU time, fastest round."""
    from prefix_sidecar.config import build_config
    from prefix_sidecar.membership.pool import BackendPool
    from prefix_sidecar.membership.sources import Member
    from prefix_sidecar.prefixes import PrefixStore
    from prefix_sidecar.routing.policy import make_policy
    from prefix_sidecar.routing.router import Router
    from prefix_sidecar.routing.router_settings import settings as router_settings

    config = build_config({})
    pool = BackendPool(warm_before_serve=False)
    pool.set_members([Member(url, 1) for url in pod_names(ROUTER_PODS)])
    for url in pod_names(ROUTER_PODS):
        pool.set_health(url, True)
    store = PrefixStore()
    # The window route: what the one-call path serves (organic has its own section).
    settings = router_settings(build_config({"unregistered_routing": "window"}))
    policy = make_policy("prefix_affinity", config)
    routers = {
        "one_call": Router(pool, store, policy, **settings),
        "three_calls": Router(pool, store, _SelectOnly(policy), **settings),
    }
    rng = random.Random(seed)
    prompts = [f"user {rng.randrange(10**9)} asks where order {i} is. " * 3 for i in range(count)]
    once = Timer(timer.budget_s / 2, 1, time.thread_time_ns)
    best: dict[str, float] = {}
    for _ in range(SCALE_ROUNDS if timer.repeats > 3 else 3):
        for name, router in routers.items():
            ns = once.ns_per_call(_loop1(router.for_prompt, prompts), count)
            best[name] = min(ns, best.get(name, ns))
    return best


def churn(c_core: Any, sample_keys: int, seed: int) -> dict[str, dict[str, Any]]:
    """Keys moved when one pod of CHURN_PODS leaves: the ring against the Maglev table."""
    pods = pod_names(CHURN_PODS)
    leaving = pods[len(pods) // 2]
    survivors = [pod for pod in pods if pod != leaving]
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(sample_keys)]
    result = {}
    for kind in SCALE_TABLES:
        before = c_core.make_table(kind, pods, None, c_core.DEFAULT_VNODES)
        after = c_core.make_table(kind, survivors, None, c_core.DEFAULT_VNODES)
        moved = stray = 0
        for key in keys:
            was, now = before.owner(key), after.owner(key)
            if was != now:
                moved += 1
                stray += was != leaving
        result[kind] = {
            "moved_pct": 100.0 * moved / len(keys),
            "stray_pct": 100.0 * stray / len(keys),
            "leaving_share_pct": 100.0 * before.shares()[leaving],
            "busiest_over_mean": max(before.shares().values()) * CHURN_PODS,
        }
    return result


def run_bench(
    quick: bool,
    pod_counts: Sequence[int],
    seed: int,
    progress: Callable[[str], None],
    scale_pods: Sequence[int] = SCALE_PODS,
) -> dict[str, Any]:
    # Directly: the bench is about the extension; fail if it is missing.
    import prefix_sidecar._core_c as _core_c

    cores = {"cython": _core_c, "python": _core_py}
    timer = Timer(budget_s=0.005 if quick else 0.05, repeats=3 if quick else 7)
    count = 200 if quick else 1000
    sample_keys = 2000 if quick else 20000
    report: dict[str, Any] = {
        "machine": machine_info(),
        "params": {
            "quick": quick,
            "pods": list(pod_counts),
            "default_vnodes": _core_c.DEFAULT_VNODES,
            "keys_per_loop": count,
            "repeats": timer.repeats,
            "budget_ms_per_repeat": timer.budget_s * 1e3,
            "moved_sample_keys": sample_keys,
            "seed": seed,
            "scale_pods": list(scale_pods),
        },
        "definitions": DEFINITIONS,
        "latency_ns": {},
        "rings": {},
    }
    report["machine"]["loop_overhead_ns"] = timer.ns_per_call(_loop_empty(range(count)), count)
    for pods_count in pod_counts:
        pods = pod_names(pods_count)
        latency: dict[str, dict[str, float]] = {"owner": {}, "pick": {}, "route": {}}
        rings: dict[str, dict[str, Any]] = {}
        for impl in IMPLEMENTATIONS:
            progress(f"{pods_count} pods: {impl}")
            core = cores.get(impl)
            build_ms, subject = _build_ms(impl, core, pods, quick)
            quality = ring_quality(impl, core, subject, pods, sample_keys, random.Random(seed))
            rings[impl] = {"build_ms": build_ms, **quality}
            for op, ns in latencies(impl, subject, core, pods, timer, count, seed).items():
                latency[op][impl] = ns
        report["latency_ns"][str(pods_count)] = latency
        report["rings"][str(pods_count)] = rings
    report["ratios"] = {
        pods: {
            op: {base: by_impl[base] / by_impl["cython"] for base in BASELINES}
            for op, by_impl in ops.items()
        }
        for pods, ops in report["latency_ns"].items()
    }
    report["targets"] = [
        {
            "name": f"{op}() at {TARGET_PODS} pods: cython >= {target:g}x faster than {base}",
            "ratio": report["ratios"][str(TARGET_PODS)][op][base],
            "measured": f"{report['ratios'][str(TARGET_PODS)][op][base]:.1f}x",
            "target": target,
            "met": report["ratios"][str(TARGET_PODS)][op][base] >= target,
        }
        for op, target in TARGETS.items()
        for base in BASELINES
        if str(TARGET_PODS) in report["ratios"]
    ]
    report["scaling"] = scaling(_core_c, scale_pods, timer, count, seed, progress)
    progress("churn")
    report["churn"] = churn(_core_c, sample_keys, seed)
    progress("router")
    report["router_ns"] = router_paths(count, timer, seed)
    if len(scale_pods) > 1:
        few, most = min(scale_pods), max(scale_pods)
        for kind in SCALE_TABLES:
            ratio = report["scaling"]["ratio_most_over_fewest"][kind]["pick"]
            report["targets"].append(
                {
                    "name": f"pick() at {most:,} pods <= {SCALE_TARGET:g}x its cost at {few} "
                    f"({kind}, total given)",
                    "ratio": ratio,
                    "measured": f"{ratio:.2f}x",
                    "target": SCALE_TARGET,
                    "met": ratio <= SCALE_TARGET,
                }
            )
    progress("throughput")
    report["throughput_mb_s"] = throughput(_core_c, timer)
    progress("organic decisions")
    report["organic"] = organic_decisions(quick, seed)  # issue 14: its own section
    return report


def _fmt_ns(ns: float) -> str:
    return f"{ns:,.0f}" if ns >= 100 else f"{ns:.1f}"


def render(report: dict[str, Any]) -> str:
    machine, params = report["machine"], report["params"]
    lines = [
        "prefix-sidecar bench core - routing contract v1, "
        f"DEFAULT_VNODES={params['default_vnodes']}" + ("  [--quick]" if params["quick"] else ""),
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['implementation']} "
        f"{machine['python']}, {machine['platform']}",
        f"harness: median of {params['repeats']} repeats, {params['keys_per_loop']} keys per "
        f"loop; loop overhead {machine['loop_overhead_ns']:.1f} ns/call (included below)",
        "",
        "decision latency, median ns per call (lower is better)",
        f"{'pods':>5}  {'op':<7}"
        + "".join(f"{impl:>11}" for impl in IMPLEMENTATIONS)
        + f"{'x uhashring':>13}{'x note':>9}",
    ]
    for pods, ops in report["latency_ns"].items():
        for op, by_impl in ops.items():
            ratios = report["ratios"][pods][op]
            lines.append(
                f"{pods:>5}  {op:<7}"
                + "".join(f"{_fmt_ns(by_impl[impl]):>11}" for impl in IMPLEMENTATIONS)
                + f"{ratios['uhashring']:>12.1f}x{ratios['note']:>8.1f}x"
            )
    lines += [
        "",
        "rings: build, balance, churn (moved: one pod leaves; ideal = 1/N)",
        f"{'pods':>5}  {'impl':<10}{'points':>9}{'build ms':>10}{'busiest/mean':>14}"
        f"{'moved %':>9}{'its share %':>12}{'ideal %':>9}{'stray':>7}",
    ]
    for pods, rings in report["rings"].items():
        for impl, ring in rings.items():
            lines.append(
                f"{pods:>5}  {impl:<10}{ring['points']:>9,}{ring['build_ms']:>10.1f}"
                f"{ring['busiest_over_mean']:>14.3f}{ring['moved_pct']:>9.3f}"
                f"{ring['leaving_share_pct']:>12.3f}{ring['ideal_pct']:>9.3f}"
                f"{ring['stray_moves']:>7}"
            )
    scale = report["scaling"]
    ops = ("owner", "pick", "pick_summed", "pick_bytes")
    lines += [
        "",
        "decision cost as the fleet grows (cython, median ns per call; pick: total given)",
        f"{'pods':>6}  {'table':<8}" + "".join(f"{op.replace('_', ' '):>13}" for op in ops),
    ]
    for pods, tables in scale["latency_ns"].items():
        for kind, by_op in tables.items():
            lines.append(
                f"{int(pods):>6,}  {kind:<8}" + "".join(f"{_fmt_ns(by_op[op]):>13}" for op in ops)
            )
    few, most = min(scale["pods"]), max(scale["pods"])
    for kind, ratios in scale["ratio_most_over_fewest"].items():
        lines.append(
            f"  {kind}: {most:,} pods / {few} pods = "
            + ", ".join(f"{op.replace('_', ' ')} {ratios[op]:.2f}x" for op in ops)
        )
    lines += [
        "",
        f"churn: one pod of {CHURN_PODS} leaves (ideal = its share)",
        f"  {'table':<8}{'moved %':>9}{'its share %':>13}{'stray %':>9}{'busiest/mean':>14}",
    ]
    for kind, moved in report["churn"].items():
        lines.append(
            f"  {kind:<8}{moved['moved_pct']:>9.3f}{moved['leaving_share_pct']:>13.3f}"
            f"{moved['stray_pct']:>9.3f}{moved['busiest_over_mean']:>14.3f}"
        )
    paths = report["router_ns"]
    lines += [
        "",
        f"Router.for_prompt, unregistered prompts, {ROUTER_PODS} pods (thread CPU ns): "
        f"one call (pick_bytes) {_fmt_ns(paths['one_call'])}, route_key + Pick + select "
        f"{_fmt_ns(paths['three_calls'])} ({paths['three_calls'] / paths['one_call']:.2f}x)",
    ]
    lines += ["", f"throughput on a {PROMPT_BYTES // 1024} KB prompt, MB/s"]
    for name, mb_s in report["throughput_mb_s"].items():
        lines.append(f"  {name:<28}{mb_s:>10,.0f}")
    if "organic" in report:
        lines += render_organic(report["organic"])
    lines += ["", "targets (ratios from this run)"]
    lines += target_lines(report["targets"])
    if str(TARGET_PODS) not in report["ratios"]:
        lines.append(f"  (speed-up targets not evaluated: {TARGET_PODS} pods were not measured)")
    lines += ["", "what each line measures"]
    lines += [f"  {name}: {text}" for name, text in report["definitions"].items()]
    return "\n".join(lines)


def _pod_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        message = f"--pods wants comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError("--pods: each pod count must be >= 2")
    return counts


SUMMARY = "routing core vs uhashring and docs/mission.md's router: ns/decision, balance, churn"


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(bench_subparsers, "core", SUMMARY, __doc__)
    parser.add_argument("--quick", action="store_true", help="small reps, 8 and 100 pods only")
    parser.add_argument("--pods", type=_pod_counts, help="pod counts, e.g. 8,100,1000")
    parser.add_argument(
        "--scale-pods",
        type=_pod_counts,
        help="pod counts of the scaling part, ring and Maglev (default 10,100,1000,5000)",
    )
    add_json_option(parser)
    parser.add_argument("--seed", type=int, default=7, help="seed for keys and loads")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    pod_counts = args.pods or ([8, 100] if args.quick else [8, 100, 1000])
    progress = progress_printer("bench core")
    report = run_and_report(
        "bench core",
        lambda: run_bench(
            args.quick, pod_counts, args.seed, progress, args.scale_pods or SCALE_PODS
        ),
        render,
        args.json,
    )
    return 130 if report is None else 0
