"""Liveness and readiness over HTTP on the metrics port, for Kubernetes' httpGet probes
(well under a millisecond each; an exec probe would start a Python process).

- `/livez`: 200 while the event loop answers (the handler runs on it).
- `/readyz`: 200 when this sidecar should get traffic, else 503 with the reason: no pod
  serving (healthy and warm); at start, the first members' warm-before-serve not over (each
  prewarm done, failed or timed out), or a start gate holding (kv_events: the pods' KV-event
  history not yet read); draining after SIGTERM. A pod that joins later warms without making
  the sidecar unready: the others still serve.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from aiohttp import web

from prefix_sidecar.membership.pool import SERVING, WARMING

LIVE_PATH = "/livez"
READY_PATH = "/readyz"


class Readiness:
    """Whether this sidecar should get traffic. Fed every pod state change (`observe`),
    read by each probe (`reason`): a probe costs a dictionary lookup, not a pool walk."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._started = False  # the first members' warm-before-serve is over
        self._draining = False
        self._gates: list[Callable[[], str | None]] = []  # each: why not yet, or None

    def gate(self, holding: Callable[[], str | None]) -> None:
        """Not ready at start while `holding()` says why; once every gate has opened, it
        is not asked again (each bounds its own wait)."""
        self._gates.append(holding)

    def observe(self, states: Iterable[str]) -> None:
        """The state of every member, after each change of the pool."""
        self._counts = Counter(states)
        if not self._started and self._counts[SERVING] and not self._counts[WARMING]:
            self._started = True

    def drain(self) -> None:
        """Shutting down: not ready again, whatever the pods do."""
        self._draining = True

    @property
    def started(self) -> bool:
        return self._started

    def reason(self) -> str | None:
        """Why this sidecar is not ready, or None when it is."""
        counts = self._counts
        members = sum(counts.values())
        if self._draining:
            return "draining: shutting down"
        if not members:
            return "no backends in the membership"
        if not self._started and counts[WARMING]:
            return (
                f"warming before serve: {counts[WARMING]} of {members} pods warming, "
                f"{counts[SERVING]} serving"
            )
        if not counts[SERVING]:
            summary = ", ".join(f"{count} {state}" for state, count in sorted(counts.items()))
            return f"no backend serving ({summary})"
        while self._gates:
            why = self._gates[0]()
            if why is not None:
                return why
            self._gates.pop(0)
        return None


def probe_routes(readiness: Readiness) -> list[web.RouteDef]:
    """The two probe endpoints, to serve beside /metrics."""

    async def livez(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        why = readiness.reason()
        if why is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {why}\n")

    return [web.get(LIVE_PATH, livez), web.get(READY_PATH, readyz)]
