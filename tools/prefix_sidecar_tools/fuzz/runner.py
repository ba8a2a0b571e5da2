"""Run fuzz cases against a target and judge each outcome."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from prefix_sidecar_tools.fuzz.cases import RESPONSES, SERVICE, STREAMING, Case, cases
from prefix_sidecar_tools.fuzz.target import FuzzTarget

# --- running cases ---------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str
    message: str
    replies: list[bytes]


def execute(channel: grpc.Channel, case: Case, timeout: float) -> Outcome:
    """Send raw bytes (identity serializers) and collect the status; never raises RpcError."""
    try:
        replies: list[bytes]
        if case.rpc in STREAMING:
            stream: grpc.UnaryStreamMultiCallable[bytes, bytes]
            stream = channel.unary_stream(SERVICE + case.rpc)
            replies = list(stream(case.payload, timeout=timeout))
        else:
            unary: grpc.UnaryUnaryMultiCallable[bytes, bytes]
            unary = channel.unary_unary(SERVICE + case.rpc)
            replies = [unary(case.payload, timeout=timeout)]
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "", [])
    return Outcome("OK", "", replies)


def problems(case: Case, outcome: Outcome, url: str) -> list[str]:
    """What is wrong with this answer to this case (empty: documented behaviour)."""
    found = []
    if outcome.status not in case.allowed:
        found.append(f"status {outcome.status} ({outcome.message!r}) not in {sorted(case.allowed)}")
    if outcome.status != "OK" and not outcome.message.strip():
        found.append(f"status {outcome.status} without a message")
    if outcome.status == "OK":
        replies = [RESPONSES[case.rpc].FromString(r) for r in outcome.replies]
        if case.rpc in ("Complete", "Chat") and not (replies and replies[0].backend == url):
            found.append(f"OK stream without a first chunk naming the backend: {replies[:2]}")
        if case.rpc == "Route" and replies[0].backend != url:
            found.append(f"OK Route without the backend: {replies[0]}")
        if case.rpc == "Prewarm" and not replies:
            found.append("OK Prewarm without events")
    return found


@dataclass
class Fuzzer:
    """Runs cases against a target, tallies statuses, probes health every `probe_every`."""

    target: FuzzTarget
    timeout_s: float = 10.0
    probe_every: int = 200
    counts: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    # (rpc, input class) -> the statuses allowed for it, for every class that ran.
    classes: dict[tuple[str, str], frozenset[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    cases_run: int = 0

    def check(self, case: Case) -> None:
        assert self.target.channel is not None
        started = time.monotonic()
        outcome = execute(self.target.channel, case, self.timeout_s)
        elapsed = time.monotonic() - started
        self.cases_run += 1
        self.counts[(case.rpc, outcome.status)] += 1
        self.classes[(case.rpc, case.kind)] = case.allowed
        found = problems(case, outcome, self.target.url)
        if outcome.status == "DEADLINE_EXCEEDED":
            found.append(f"hang: no answer within {self.timeout_s} s ({elapsed:.1f} s)")
        if self.cases_run % self.probe_every == 0:
            found += self.health()
        if found:
            raise AssertionError(f"{case!r}: " + "; ".join(found))

    def health(self) -> list[str]:
        if not self.target.alive():
            return [f"a process died: {[p.returncode for p in self.target.processes]}"]
        try:
            self.target.probe()
        except (AssertionError, grpc.RpcError) as exc:
            return [f"the sidecar no longer serves a good request: {exc}"]
        return []

    def run(
        self,
        rpc: str,
        examples: int,
        seed: int | None = None,
        strategy: st.SearchStrategy[Case] | None = None,
    ) -> None:
        """`examples` hypothesis cases of one RPC (all its input classes unless `strategy`
        is given); raises AssertionError with the shrunk failing case."""
        if strategy is None:
            strategy = cases(rpc, self.target.known, self.target.limits)

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.generate, Phase.shrink),
        )
        @given(strategy)
        def fuzz_one(case: Case) -> None:
            self.check(case)

        if seed is not None:
            fuzz_one = hypothesis_seed(seed)(fuzz_one)
        fuzz_one()
