"""What became of one relayed request: the pool and pod that answered, the attempts it took,
its status, time to first token and token usage, and each failed attempt's reason.

A leaf, so that the relay, the fronts' exchanges and the request log can all name it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RelayOutcome:
    pool: str = ""  # the pool the request's model picked ("": refused before that)
    backend: str = ""
    attempts: int = 0
    status: str = "OK"
    ttft_s: float | None = None
    usage: tuple[int, int, int] = (0, 0, 0)
    errors: list[str] = field(default_factory=list)
