"""The organic trace of `bench organic`: traffic nobody registered, as ordinary callers send it.

Three classes of request, each tagged with its class, its tenant (or template) and its flow:
- tenant: a one-shot request, a tenant's system prompt (300-3,000 bytes) plus a user message;
- session: a multi-turn chat of a tenant, 4-10 turns; each turn's prompt is the previous
  prompt + the previous answer + a new user message, sent a few seconds after the previous
  turn's answer ended (closed loop, as a person types);
- fewshot: a template's instruction and worked examples (a shared block of a few KB) plus
  a new query.
Tenants and templates have Zipf popularity. Arrivals are Poisson per class (modelled seconds).

Answers are written by the trace, not taken from the pods: the emulator caches prompt blocks
only, so the next turn's hit depends on the previous PROMPT, and a fixed answer keeps the
trace, hence the oracle, identical for every policy. Every request is a chat (messages); the
raw-prompt paths send its ChatML rendering (the emulator's own render_chat), so all paths
put the same bytes in front of the pod and share one oracle.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefix_sidecar_tools.emulator.protocol import render_chat
from prefix_sidecar_tools.workload.texts import BANNED, CATEGORIES, MECHANICS, PRODUCTS
from prefix_sidecar_tools.workload.trace import zipf_weights

CLASSES = ("tenant", "session", "fewshot")
NOMINAL_ANSWER_S = 0.5  # the oracle's ordering assumes an answer takes this long (modelled)

Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True)
class TraceParams:
    seed: int = 0
    duration_s: float = 60.0  # flows start within this many modelled seconds
    tenants: int = 24
    templates: int = 6
    zipf: float = 1.0
    tenant_rate: float = 4.0  # one-shot requests per modelled second
    fewshot_rate: float = 3.0
    session_rate: float = 0.7  # sessions started per modelled second
    min_turns: int = 4
    max_turns: int = 10
    min_gap_s: float = 1.0  # think time between a turn's answer and the next turn
    max_gap_s: float = 5.0
    system_bytes: tuple[int, int] = (300, 3000)

    @classmethod
    def of_settings(cls, settings: Mapping[str, Any]) -> TraceParams:
        """The trace of `bench organic`'s settings: its flags (vars(args)) or a report's
        "params", which are the same names."""
        return cls(
            seed=settings["seed"],
            duration_s=settings["duration"],
            tenants=settings["tenants"],
            templates=settings["templates"],
            zipf=settings["zipf"],
            tenant_rate=settings["tenant_rate"],
            fewshot_rate=settings["fewshot_rate"],
            session_rate=settings["session_rate"],
        )

    def validate(self) -> None:
        if self.duration_s <= 0:
            raise ValueError(f"duration must be > 0, got {self.duration_s}")
        if self.tenants < 1 or self.templates < 1:
            raise ValueError("need at least one tenant and one few-shot template")
        if min(self.tenant_rate, self.fewshot_rate, self.session_rate) < 0:
            raise ValueError("rates must be >= 0")
        if self.tenant_rate + self.fewshot_rate + self.session_rate <= 0:
            raise ValueError("at least one rate must be > 0")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(
                f"need 1 <= min_turns <= max_turns, got {self.min_turns}, {self.max_turns}"
            )
        if not 0 <= self.min_gap_s <= self.max_gap_s:
            raise ValueError("need 0 <= min_gap_s <= max_gap_s")


@dataclass(frozen=True)
class OrganicRequest:
    seq: int  # index in the trace, in nominal order
    kind: str  # one of CLASSES
    owner: int  # tenant index (tenant, session) or template index (fewshot)
    flow: int  # the flow (session or one-shot) it belongs to
    turn: int  # 0-based turn within its flow
    messages: tuple[Message, ...]
    prompt: str  # the ChatML rendering the pod sees
    gap_s: float  # modelled seconds after the previous turn's answer (0 for a first turn)
    nominal_at: float  # modelled send time if every answer took NOMINAL_ANSWER_S

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass(frozen=True)
class Flow:
    """Requests sent one after the other: a session's turns, or one one-shot request."""

    index: int
    start_s: float  # modelled
    requests: tuple[OrganicRequest, ...]


@dataclass
class OrganicTrace:
    params: TraceParams
    flows: list[Flow]
    requests: list[OrganicRequest]  # every request, in nominal order (seq order)
    system_prompts: list[str] = field(default_factory=list)
    template_blocks: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        counted = dict.fromkeys(CLASSES, 0)
        for request in self.requests:
            counted[request.kind] += 1
        return counted


_WORDS = tuple(
    word
    for phrase in (*CATEGORIES, *MECHANICS, *PRODUCTS, *BANNED)
    for word in phrase.split()
    if word.isascii()
)


def prose(rng: random.Random, size: int, head: str = "") -> str:
    """About `size` bytes of ASCII sentences (exactly `size` when size > len(head))."""
    text = head
    while len(text) < size:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14)))
        text += sentence[0].upper() + sentence[1:] + ". "
    return text[:size] if size > len(head) else text


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(low * (high / low) ** rng.random())


def system_prompt(rng: random.Random, tenant: int, size: int) -> str:
    head = (
        f"You are the shopping assistant of store #{tenant} ({rng.choice(CATEGORIES)}). "
        "Follow the store policy below. "
    )
    return prose(rng, size, head)


def fewshot_template(rng: random.Random, template: int) -> tuple[Message, ...]:
    """A template's fixed messages: an instruction, then 3-6 worked examples."""
    task = rng.choice(("classify the complaint", "extract the price", "rewrite the title"))
    messages: list[Message] = [
        ("system", prose(rng, rng.randint(150, 400), f"Template {template}: {task}. "))
    ]
    for example in range(rng.randint(3, 6)):
        messages.append(("user", prose(rng, rng.randint(150, 500), f"Example {example}: ")))
        messages.append(("assistant", prose(rng, rng.randint(100, 300))))
    return tuple(messages)


def _poisson_starts(rng: random.Random, rate: float, duration: float) -> list[float]:
    starts: list[float] = []
    if rate <= 0:
        return starts
    at = rng.expovariate(rate)
    while at < duration:
        starts.append(at)
        at += rng.expovariate(rate)
    return starts


def build_trace(params: TraceParams) -> OrganicTrace:
    """The seeded trace: same params, same requests, byte for byte."""
    params.validate()
    rng = random.Random(f"organic-{params.seed}")
    systems = [
        system_prompt(rng, t, _log_uniform(rng, *params.system_bytes))
        for t in range(params.tenants)
    ]
    templates = [fewshot_template(rng, f) for f in range(params.templates)]
    tenant_weights = zipf_weights(params.tenants, params.zipf)
    template_weights = zipf_weights(params.templates, params.zipf)
    drafts: list[tuple[float, str, int, list[tuple[tuple[Message, ...], float]]]] = []
    for at in _poisson_starts(rng, params.tenant_rate, params.duration_s):
        tenant = rng.choices(range(params.tenants), tenant_weights)[0]
        user = prose(rng, rng.randint(60, 400), "Question: ")
        drafts.append(
            (at, "tenant", tenant, [((("system", systems[tenant]), ("user", user)), 0.0)])
        )
    for at in _poisson_starts(rng, params.fewshot_rate, params.duration_s):
        template = rng.choices(range(params.templates), template_weights)[0]
        query = prose(rng, rng.randint(80, 300), "Input: ")
        drafts.append((at, "fewshot", template, [((*templates[template], ("user", query)), 0.0)]))
    for at in _poisson_starts(rng, params.session_rate, params.duration_s):
        tenant = rng.choices(range(params.tenants), tenant_weights)[0]
        history: list[Message] = [("system", systems[tenant])]
        turns: list[tuple[tuple[Message, ...], float]] = []
        for turn in range(rng.randint(params.min_turns, params.max_turns)):
            if turn:
                history.append(("assistant", prose(rng, rng.randint(150, 700), "Answer: ")))
            history.append(("user", prose(rng, rng.randint(60, 400), f"Turn {turn}: ")))
            gap = rng.uniform(params.min_gap_s, params.max_gap_s) if turn else 0.0
            turns.append((tuple(history), gap))
        drafts.append((at, "session", tenant, turns))
    drafts.sort(key=lambda draft: draft[0])

    pending: list[tuple[float, int, int, str, int, tuple[Message, ...], float]] = []
    for flow, (start, kind, owner, turns) in enumerate(drafts):
        nominal = start
        for turn, (messages, gap) in enumerate(turns):
            nominal += (NOMINAL_ANSWER_S + gap) if turn else 0.0
            pending.append((nominal, flow, turn, kind, owner, messages, gap))
    pending.sort(key=lambda item: (item[0], item[1], item[2]))
    requests: list[OrganicRequest] = []
    by_flow: dict[int, list[OrganicRequest]] = {}
    for seq, (nominal, flow, turn, kind, owner, messages, gap) in enumerate(pending):
        request = OrganicRequest(
            seq=seq,
            kind=kind,
            owner=owner,
            flow=flow,
            turn=turn,
            messages=messages,
            prompt=render_chat([{"role": r, "content": c} for r, c in messages]),
            gap_s=gap,
            nominal_at=nominal,
        )
        requests.append(request)
        by_flow.setdefault(flow, []).append(request)
    flows = [
        Flow(index, drafts[index][0], tuple(sorted(by_flow[index], key=lambda r: r.turn)))
        for index in range(len(drafts))
    ]
    return OrganicTrace(
        params=params,
        flows=flows,
        requests=requests,
        system_prompts=systems,
        template_blocks=[render_chat([{"role": r, "content": c} for r, c in t]) for t in templates],
    )


def router_of(request: OrganicRequest, count: int, pin_flows: bool = False) -> int:
    """Which of `count` routers (sidecars, radix replicas) sends `request`: one drawn at
    random per request, seeded by its sequence number (callers spread over the routers
    without regard to conversations), or with `pin_flows` one per flow (a router per caller,
    and a conversation kept on one caller)."""
    if count == 1:
        return 0
    seed = f"organic-flow-{request.flow}" if pin_flows else f"organic-sidecar-{request.seq}"
    return random.Random(seed).randrange(count)
