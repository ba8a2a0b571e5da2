"""Generate tests/core/golden.json: the golden vectors of routing contract v1.

Run `python tests/core/make_golden.py` ONLY on a deliberate contract change (and bump
CONTRACT_VERSION): every sidecar and every client in another language must reproduce these
vectors to the bit, so a regenerated file means all of them must change together. (The
min_cap vectors were added to v1 without a version bump: min_cap = 0 is the original pick, so
every earlier vector kept its result; so were the Maglev table's, section 8, an option that
leaves every ring result as it was, organic routing's, section 9, which adds functions, and
the request cost's, section 4, whose u = 1 is the original pick.)

The vectors come from the small, slow reference below, written straight from
docs/routing-contract.md and independent of both twins (it imports neither), so a bug the
two twins share cannot hide in its own golden vectors. Values of 64 bits (keys, points,
arcs) are written as decimal strings: JSON numbers above 2**53 lose precision in many
languages.
"""

from __future__ import annotations

import hashlib
import json
import math
from bisect import bisect_left
from pathlib import Path
from typing import Any

import mmh3

CONTRACT_VERSION = 1
CONTRACT_DEFAULT_VNODES = 1024
CONTRACT_DEFAULT_TABLE_SIZE = 65537
KEY_SPACE = 1 << 64
GOLDEN_PATH = Path(__file__).with_name("golden.json")


# --- the reference: contract v1, one rule per function ------------------------------------


def key(data: bytes) -> int:
    """Rule 1: the first 64-bit word of MurmurHash3_x64_128(data, seed=0), unsigned."""
    return int(mmh3.hash64(data, seed=0, signed=False)[0])


def ring_points(members: list[str], weights: list[int], vnodes: int) -> list[tuple[int, str]]:
    """Rule 3: key(f"{m}#{i}") for i < vnodes * w, sorted by (point, member by code point)."""
    points = [
        (key(f"{m}#{i}".encode()), m)
        for m, w in zip(members, weights, strict=True)
        for i in range(vnodes * w)
    ]
    return sorted(points)


def preference(points: list[tuple[int, str]], k: int, n: int) -> list[str]:
    """Rule 4: the first n distinct members clockwise from the first point >= k (wrapping)."""
    start = bisect_left([p for p, _ in points], k) % len(points)
    n = min(n, len({m for _, m in points}))
    found: list[str] = []
    position = start
    while len(found) < n:
        member = points[position][1]
        if member not in found:
            found.append(member)
        position = (position + 1) % len(points)
    return found


def fits(
    load: int, c: float, total: int, w: int, total_w: int, min_cap: int = 0, u: int = 1
) -> bool:
    """Rule 5: load + u <= max(min_cap, ceil(((c * (L + u)) * w) / W)), the ceil in doubles,
    every comparison exact (the floor is an int and is never turned into a double); u is the
    request's cost, 1 when load counts requests."""
    if load + u <= min_cap:
        return True
    limit = c * float(total + u) * float(w) / float(total_w)
    return math.isinf(limit) or load + u <= math.ceil(limit)


def pick(
    points: list[tuple[int, str]],
    members: list[str],
    weights: list[int],
    k: int,
    loads: list[int],
    replicas: int,
    c: float,
    min_cap: int = 0,
    u: int = 1,
) -> tuple[str, str]:
    """Rule 5: bounded-load pick with a floor on every cap; returns (member, branch)."""
    home = preference(points, k, replicas)
    return pick_among(points, members, weights, k, loads, home, c, min_cap, u)


def pick_among(
    points: list[tuple[int, str]],
    members: list[str],
    weights: list[int],
    k: int,
    loads: list[int],
    home: list[str],
    c: float,
    min_cap: int = 0,
    u: int = 1,
) -> tuple[str, str]:
    """Rule 5b: pick with the home set given (distinct members) instead of preference(k, R)."""
    order = preference(points, k, len(members))
    return bounded(members, weights, loads, home, order, c, min_cap, u)


def bounded(
    members: list[str],
    weights: list[int],
    loads: list[int],
    home: list[str],
    order: list[str],
    c: float,
    min_cap: int,
    u: int = 1,
) -> tuple[str, str]:
    """Rules 5/5b over any table: the home set, then the spill walk over `order`, the key's
    whole preference order (the ring's, or the Maglev table's: rule 8)."""
    load = dict(zip(members, loads, strict=True))
    weight = dict(zip(members, weights, strict=True))
    total, total_w = sum(loads), sum(weights)
    chosen = min(home, key=lambda m: (load[m], home.index(m)))
    if fits(load[chosen], c, total, weight[chosen], total_w, min_cap, u):
        return chosen, "home"
    for m in order:
        if m != chosen and fits(load[m], c, total, weight[m], total_w, min_cap, u):
            return m, "spill"
    return min(order, key=lambda m: (load[m], order.index(m))), "fallback"


def place(
    points: list[tuple[int, str]],
    weights: dict[str, int],
    prefixes: list[tuple[int, int, int, str]],
    budget: int,
    balance: float = 0.0,
) -> dict[str, list[str]]:
    """Rule 6: budgeted home placement of (key, tokens, replicas, id) prefixes; home sets by id.

    A member's room is budget * weight, and with balance f > 0 at most
    ceil(((f * double(T)) * double(w)) / double(W)), T = sum of tokens * min(R, N).
    Largest first (ties: smaller key, then smaller id); each takes the first R members of its
    preference order whose homed tokens + its tokens stay within their room; if fewer than
    R have room, the rest are the least-filled others by homed / weight (exact), ties to the
    earlier in preference order; a home set is listed in preference order."""
    count = len(weights)
    room = {m: budget * w for m, w in weights.items()}
    if balance > 0:
        total = sum(t * min(r, count) for _, t, r, _ in prefixes)
        total_w = sum(weights.values())
        for m, w in weights.items():
            room[m] = min(room[m], math.ceil(balance * float(total) * float(w) / float(total_w)))
    used = dict.fromkeys(weights, 0)
    homes: dict[str, list[str]] = {}
    for k, tokens, replicas, prefix_id in sorted(prefixes, key=lambda p: (-p[1], p[0], p[3])):
        order = preference(points, k, count)
        want = min(replicas, count)
        roomy = [m for m in order if used[m] + tokens <= room[m]][:want]
        others = [m for m in order if m not in roomy]
        # Exact ratio comparison by cross-multiplying; sorted() is stable: ties keep order.
        others = sorted(
            others,
            key=lambda m: [used[m] * weights[n] > used[n] * weights[m] for n in others].count(True),
        )
        taken = set(roomy) | set(others[: want - len(roomy)])
        homes[prefix_id] = [m for m in order if m in taken]
        for m in homes[prefix_id]:
            used[m] += tokens
    return homes


def maglev_table(members: list[str], weights: list[int], size: int) -> list[str]:
    """Rule 8: the Maglev table. Members in code-point order; member m's permutation is
    (offset + j * skip) mod M, offset = key(m) mod M, skip = h1(m, seed 1) mod (M - 1) + 1.
    In rounds t = 1, 2, ..., each member (in that order) whose next entry, its k-th, is due
    now - ceil(k * max_w / w) == t - takes the first empty entry along its permutation from
    where it stopped; until all M entries are taken. Slow and literal, on purpose."""
    order = sorted(members)
    weight = dict(zip(members, weights, strict=True))
    max_w = max(weights)
    offset = {m: key(m.encode()) % size for m in order}
    skip = {m: mmh3.hash64(m.encode(), seed=1, signed=False)[0] % (size - 1) + 1 for m in order}
    tried = dict.fromkeys(order, 0)
    owned = dict.fromkeys(order, 0)
    table: list[str | None] = [None] * size
    filled, t = 0, 0
    while filled < size:
        t += 1
        for m in order:
            if filled == size or -(-(owned[m] + 1) * max_w // weight[m]) != t:
                continue
            j = tried[m]
            while table[(offset[m] + j * skip[m]) % size] is not None:
                j += 1
            table[(offset[m] + j * skip[m]) % size] = m
            tried[m], owned[m], filled = j + 1, owned[m] + 1, filled + 1
    assert all(owned.values()), "every member must own an entry"
    return [m for m in table if m is not None]


def maglev_preference(table: list[str], k: int, n: int) -> list[str]:
    """Rule 8: the first n distinct members of the entries k mod M, k mod M + 1, ... (wrapping)."""
    n = min(n, len(set(table)))
    found: list[str] = []
    position = k % len(table)
    while len(found) < n:
        if table[position] not in found:
            found.append(table[position])
        position = (position + 1) % len(table)
    return found


def maglev_owned(table: list[str]) -> dict[str, int]:
    """Rule 8: entry e holds the keys k < 2**64 with k mod M == e."""
    each, extra = divmod(KEY_SPACE, len(table))
    owned: dict[str, int] = {}
    for entry, member in enumerate(table):
        owned[member] = owned.get(member, 0) + each + (1 if entry < extra else 0)
    return owned


def chain_keys(data: bytes, block: int, max_blocks: int) -> list[int]:
    """Rule 9a: c_i = key(le64(c_{i-1}) || block_i), c_{-1} = 0, full blocks only."""
    keys: list[int] = []
    parent = 0
    for i in range(min(len(data) // block, max_blocks)):
        parent = key(parent.to_bytes(8, "little") + data[i * block : (i + 1) * block])
        keys.append(parent)
    return keys


def session_home(points: list[tuple[int, str]], family: int, homes: int, session: int) -> str:
    """Rule 9b: the first of preference(session, N) that is in preference(family, homes)."""
    count = len({m for _, m in points})
    home = set(preference(points, family, homes))
    return next(m for m in preference(points, session, count) if m in home)


def home_size(share: float, members: int, spread: float) -> int:
    """Rule 9c: min(N, max(1, ceil(spread * share * N))), doubles in that order."""
    return min(members, max(1, math.ceil(spread * share * float(members))))


def message_keys(messages: list[tuple[str, str]], limit: int) -> list[int]:
    """Rule 9d: m_i = key(le64(m_{i-1}) || utf8(role) || 0x00 || utf8(content))."""
    keys: list[int] = []
    parent = 0
    for role, content in messages[:limit]:
        parent = key(parent.to_bytes(8, "little") + role.encode() + b"\x00" + content.encode())
        keys.append(parent)
    return keys


# Rule 9h: (the header a rendered conversation starts with, its assistant turn's header)
TEMPLATE_HEADERS = [
    ("<|im_start|>", "<|im_start|>assistant"),
    ("<|start_header_id|>", "<|start_header_id|>assistant<|end_header_id|>"),
    ("<start_of_turn>", "<start_of_turn>model"),
    ("[INST]", "[/INST]"),
    ("<|system|>", "<|assistant|>"),
    ("<|user|>", "<|assistant|>"),
]
TEMPLATE_BOS = ["<|begin_of_text|>", "<bos>", "<s>"]


TURN_TAIL = 8_192


def turn_marks(prompt: str) -> list[int]:
    """Rule 9h: skip ASCII whitespace (space, tab, CR, LF), then a BOS and whitespace if one
    follows; if a template's opening follows (in table order), look at the occurrences of
    its assistant header that lie wholly in the last TURN_TAIL characters: [mark, after] =
    the offsets of the last and the second-to-last (-1 for none when the tail is the whole
    prompt, -2 when it is not; [-1, -2] for no header in a whole prompt, [-2, -2] for none
    in a tail); [-2, -2] when no opening follows."""
    at = 0
    while at < len(prompt) and prompt[at] in " \t\r\n":
        at += 1
    for bos in TEMPLATE_BOS:
        if prompt.startswith(bos, at):
            at += len(bos)
            while at < len(prompt) and prompt[at] in " \t\r\n":
                at += 1
            break
    for opening, answer in TEMPLATE_HEADERS:
        if prompt.startswith(opening, at):
            low = max(0, len(prompt) - TURN_TAIL)
            whole = low == 0
            found, i = [], prompt.find(answer, low)
            while i >= 0:  # every occurrence in the tail, left to right (they cannot overlap)
                found.append(i)
                i = prompt.find(answer, i + len(answer))
            if not found:
                return [-1, -2] if whole else [-2, -2]
            before = found[-2] if len(found) > 1 else (-1 if whole else -2)
            return [found[-1], before]
    return [-2, -2]


def owned_arcs(points: list[tuple[int, str]]) -> dict[str, int]:
    """The exact number of keys each member owns: the arc (previous point, point]."""
    owned: dict[str, int] = {}
    previous = points[-1][0] - KEY_SPACE
    for point, member in points:
        owned[member] = owned.get(member, 0) + point - previous
        previous = point
    return owned


# --- the vectors ---------------------------------------------------------------------------

KEY_INPUTS: list[bytes] = [
    b"",
    b"a",
    b"hello",
    b"0123456789abcdef",  # exactly one 16-byte block
    b"0123456789abcdefg",  # one block and a 1-byte tail
    b"The quick brown fox jumps over the lazy dog",
    "前缀缓存 prefix cache ✓".encode(),
    "Ünïcödé — 🚀".encode(),
    bytes(range(256)),
    b"\x00" * 31,
]

PREFIX_TEXTS: list[str] = [
    "",
    "You are the promotion assistant. Follow the platform marketing compliance rules.",
    "平台营销合规规则：禁止使用“最低价”等绝对化用语。",
    "emoji 🛒🎁 and a NUL \x00 inside",
]

RING_A = {
    "name": "three members, weights [1, 2, 1], vnodes 4",
    "members": ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"],
    "weights": [1, 2, 1],
    "vnodes": 4,
}
RING_B = {
    "name": "five equal members, default vnodes",
    "members": [f"http://vllm-{i}.vllm.default.svc:8000" for i in range(5)],
    "weights": [1, 1, 1, 1, 1],
    "vnodes": CONTRACT_DEFAULT_VNODES,
}

# The rings the cases ask, each with the key it is asked about.
A_HELLO = (RING_A, "hello")
A_WORLD = (RING_A, "world")
B_RULES = (RING_B, "compliance-rules-v7")

# (ring, key expression, loads, replicas, factor, min_cap, what the case shows)
PICK_CASES: list[tuple[dict[str, Any], str, list[int], int, float, int, str]] = [
    (*A_HELLO, [0, 0, 0], 1, 1.25, 0, "idle fleet: the owner"),
    (*A_HELLO, [3, 1, 0], 1, 1.25, 0, "owner within its cap"),
    (*A_HELLO, [0, 9, 0], 1, 1.25, 0, "owner over its cap: spill to the next in preference"),
    (*A_HELLO, [0, 0, 0], 3, 1.25, 0, "replicas 3, all idle: ties go to the earlier in home"),
    (*A_WORLD, [0, 0, 5], 2, 1.25, 0, "replicas 2: the less-loaded home member"),
    (*A_HELLO, [2, 4, 3], 2, 1.0, 0, "chosen home member over cap: spill to the other one"),
    (*A_WORLD, [0, 4, 2], 1, 1.0, 0, "factor 1.0: the owner at its cap spills"),
    (*A_WORLD, [0, 0, 9], 1, 1e20, 0, "a cap above 2**63 still admits the owner"),
    (*A_WORLD, [0, 0, 10**9], 1, 1e300, 0, "the cap overflows to +inf: home"),
    (
        *A_HELLO,
        [2**51, 2**52, 2**51],
        1,
        1.0,
        0,
        "fallback: float(L + 1) rounds to L at 2**53, no member fits",
    ),
    (*B_RULES, [0, 0, 0, 0, 0], 1, 1.25, 0, "default ring, idle"),
    (*B_RULES, [2, 2, 40, 2, 2], 1, 1.25, 0, "default ring, hot owner spills"),
    (*B_RULES, [2, 2, 40, 2, 2], 2, 1.25, 0, "replicas 2: the other home member"),
    (*B_RULES, [3, 1, 5, 0, 4], 5, 1.25, 0, "replicas 5: least-loaded of all"),
    # The floor (min_cap): the low-traffic case it exists for, and the cases it must not touch.
    (*B_RULES, [0, 0, 1, 0, 0], 1, 1.25, 0, "no floor: a 2nd stream spills"),
    (*B_RULES, [0, 0, 1, 0, 0], 1, 1.25, 8, "floor 8 keeps the 2nd stream home"),
    (*B_RULES, [0, 0, 7, 0, 0], 1, 1.25, 8, "floor 8: the 8th stream is home"),
    (*B_RULES, [0, 0, 8, 0, 0], 1, 1.25, 8, "floor 8: the 9th stream spills"),
    (*B_RULES, [2, 2, 40, 2, 2], 1, 1.25, 8, "floor below the cap: no change"),
    (*A_HELLO, [3, 1, 0], 1, 1.25, 2, "floor below the owner's cap 4: home as before"),
    (*A_HELLO, [0, 20, 9], 1, 1.0, 0, "no floor: the spill passes 10.0.0.3 (9 + 1 > cap 8)"),
    (*A_HELLO, [0, 20, 9], 1, 1.0, 10, "floor 10: the spill stops at 10.0.0.3"),
    (*A_WORLD, [0, 0, 2**53], 1, 1.0, 2**53 + 1, "load + 1 = floor above 2**53: home"),
    (*A_WORLD, [0, 0, 2**53], 1, 1.0, 2**53, "the floor is compared exactly, not as a double"),
]


# (ring, key expression, loads, home members by index, factor, min_cap, what the case shows)
PICK_AMONG_CASES: list[tuple[dict[str, Any], str, list[int], list[int], float, int, str]] = [
    (*B_RULES, [0, 0, 0, 0, 0], [4, 0], 1.25, 0, "idle: the first given"),
    (*B_RULES, [0, 0, 0, 3, 1], [3, 4], 1.25, 8, "the less-loaded given"),
    (
        *B_RULES,
        [2, 2, 2, 2, 30],
        [4],
        1.25,
        0,
        "the given home over its cap spills in the key's preference order",
    ),
    (*B_RULES, [2, 2, 2, 30, 30], [3, 4], 1.25, 8, "both given homes over the cap: spill"),
    (*A_HELLO, [0, 0, 0], [2, 0], 1.25, 0, "a home set that is not the ring's first R"),
]

MAGLEV_A = {
    "name": "Maglev: three members, weights [1, 2, 1], 13 entries",
    "members": RING_A["members"],
    "weights": [1, 2, 1],
    "table_size": 13,
}
MAGLEV_B = {
    "name": "Maglev: five equal members, default table size",
    "members": RING_B["members"],
    "weights": [1, 1, 1, 1, 1],
    "table_size": CONTRACT_DEFAULT_TABLE_SIZE,
}

# (table, key expression, loads, replicas, homes by index or None, factor, min_cap, why)
MAGLEV_PICK_CASES: list[
    tuple[dict[str, Any], str, list[int], int, list[int] | None, float, int, str]
] = [
    (MAGLEV_A, "hello", [0, 0, 0], 1, None, 1.25, 0, "idle: the owner, entry k mod 13"),
    (MAGLEV_A, "hello", [0, 9, 0], 1, None, 1.25, 0, "the owner over its cap: spill"),
    (MAGLEV_A, "hello", [0, 0, 0], 3, None, 1.25, 0, "replicas 3: ties to the earlier"),
    (MAGLEV_A, "hello", [2**51, 2**52, 2**51], 1, None, 1.0, 0, "fallback at 2**53"),
    (MAGLEV_B, "compliance-rules-v7", [0, 0, 0, 0, 0], 1, None, 1.25, 0, "idle: the owner"),
    (MAGLEV_B, "compliance-rules-v7", [2, 2, 2, 2, 40], 1, None, 1.25, 0, "hot owner spills"),
    (MAGLEV_B, "compliance-rules-v7", [2, 2, 2, 2, 40], 2, None, 1.25, 0, "replicas 2: the other"),
    (MAGLEV_B, "compliance-rules-v7", [0, 0, 0, 0, 1], 1, None, 1.25, 0, "no floor: 2nd spills"),
    (MAGLEV_B, "compliance-rules-v7", [0, 0, 0, 0, 1], 1, None, 1.25, 8, "floor 8: home"),
    (MAGLEV_B, "compliance-rules-v7", [2, 2, 2, 30, 30], 1, [3, 4], 1.25, 0, "given homes spill"),
    (MAGLEV_B, "compliance-rules-v7", [0, 0, 0, 3, 1], 1, [3, 4], 1.25, 8, "the less-loaded given"),
]

# A request's cost u (rule 5): loads and floors in tokens (a floor of 8 thin requests of 128
# tokens is 1,024), on the rings and the Maglev table B.
MB_RULES = (MAGLEV_B, "compliance-rules-v7")
# (ring or table, key expression, loads, replicas, homes by index or None, factor, min_cap,
#  u, what the case shows)
COST_PICK_CASES: list[
    tuple[dict[str, Any], str, list[int], int, list[int] | None, float, int, int, str]
] = [
    (*B_RULES, [3, 3, 3, 3, 3], 1, None, 1.25, 0, 5, "u = 5 fits no member: the owner"),
    (*B_RULES, [3, 3, 3, 0, 3], 1, None, 1.25, 0, 5, "u = 5: only the idle member fits"),
    (*B_RULES, [2000, 2000, 2027, 2000, 2000], 1, None, 1.25, 1024, 640, "load + u = the cap"),
    (*B_RULES, [2000, 2000, 2028, 2000, 2000], 1, None, 1.25, 1024, 640, "one token over it"),
    (*B_RULES, [0, 0, 900, 0, 0], 1, None, 1.25, 1024, 124, "load + u = the floor"),
    (*B_RULES, [0, 0, 900, 0, 0], 1, None, 1.25, 1024, 125, "one token over the floor"),
    (*B_RULES, [0, 0, 0, 0, 0], 1, None, 1.25, 1024, 16384, "idle fleet, u over every cap"),
    (*A_HELLO, [0, 6, 4], 1, [2, 1], 1.25, 0, 3, "the heavier given home fits"),
    (*A_HELLO, [0, 6, 4], 1, [2, 1], 1.25, 0, 4, "no given home fits: spill on"),
    (*A_WORLD, [0, 0, 2**53], 1, None, 1.0, 2**53 + 3, 4, "load + u = the floor + 1"),
    (*A_WORLD, [0, 0, 2**53], 1, None, 1.0, 2**53 + 4, 4, "load + u = the floor, exact"),
    (*MB_RULES, [3, 3, 3, 3, 3], 1, None, 1.25, 0, 5, "u = 5 fits no member: the owner"),
    (*MB_RULES, [3, 3, 0, 3, 3], 1, None, 1.25, 0, 5, "u = 5: only the idle member fits"),
    (*MB_RULES, [2000, 2000, 2000, 2000, 2027], 1, None, 1.25, 1024, 640, "load + u = the cap"),
    (*MB_RULES, [2000, 2000, 2000, 2000, 2028], 1, None, 1.25, 1024, 640, "one token over it"),
    (*MB_RULES, [1000, 1000, 1000, 1200, 900], 1, [3, 4], 1.25, 1024, 640, "given homes over"),
]

MEGA_SALE = [
    ("rules", 60_000, 3),
    ("script", 12_000, 2),
    *((f"annex-{i}", 12_000, 1) for i in range(1, 9)),
]

# (ring, budget, balance, prefixes as (text giving key and id, tokens, replicas), what it shows)
PLACEMENT_CASES: list[tuple[dict[str, Any], int, float, list[tuple[str, int, int]], str]] = [
    (
        RING_B,
        10**9,
        0.0,
        [("rules", 60_000, 3), ("script", 12_000, 2), ("annex-1", 12_000, 1)],
        "a budget that never binds: the ring's first R owners",
    ),
    (RING_B, 100_000, 0.0, MEGA_SALE, "the mega-sale set at a binding budget: no pod over 100,000"),
    (
        RING_B,
        50_000,
        0.0,
        [("rules", 60_000, 2), ("rules-v6", 60_000, 2), ("script", 12_000, 5)],
        "prefixes larger than the budget still get R homes, least-filled first",
    ),
    (
        RING_A,
        50_000,
        0.0,
        [("a", 40_000, 1), ("b", 40_000, 1), ("c", 40_000, 1), ("d", 40_000, 1)],
        "the weight-2 member holds twice the budget",
    ),
    (
        RING_B,
        10**9,
        1.1,
        MEGA_SALE,
        "balance 1.1, no budget: room ceil(1.1 x 300,000 / 5) = 66,000; the script (R 2) "
        "finds one pod with room, the other is the least-filled",
    ),
    (
        RING_B,
        80_000,
        1.5,
        MEGA_SALE,
        "balance 1.5 (90,000) and a budget of 80,000: the smaller bound is the room",
    ),
    (
        RING_A,
        10**9,
        1.25,
        [("a", 40_000, 1), ("b", 40_000, 1), ("c", 40_000, 1), ("d", 40_000, 1)],
        "balance on a weighted ring: fair shares 50,000 / 100,000 / 50,000",
    ),
]


def ring_vectors(spec: dict[str, Any]) -> dict[str, Any]:
    members, weights, vnodes = spec["members"], spec["weights"], spec["vnodes"]
    points = ring_points(members, weights, vnodes)
    owned = owned_arcs(points)
    first = points[0][0]
    last = points[-1][0]
    probe_keys = [
        0,
        1,
        first,
        first + 1,
        points[len(points) // 2][0] - 1,
        1 << 63,
        last,
        last + 1,
        KEY_SPACE - 1,
        key(b"hello"),
        key(b"world"),
    ]
    probe_keys = sorted({k for k in probe_keys if k < KEY_SPACE})
    vectors: dict[str, Any] = {
        **spec,
        "point_count": len(points),
        "owned": {m: str(owned[m]) for m in members},
        "shares": {m: owned[m] / KEY_SPACE for m in members},
        "lookups": [
            {
                "key": str(k),
                "owner": preference(points, k, 1)[0],
                "preference_2": preference(points, k, 2),
                "preference_all": preference(points, k, len(members)),
            }
            for k in probe_keys
        ],
    }
    if len(points) <= 64:
        vectors["points"] = [[str(p), m] for p, m in points]
    else:
        vectors["points_head"] = [[str(p), m] for p, m in points[:8]]
    return vectors


def maglev_vectors(spec: dict[str, Any]) -> dict[str, Any]:
    members, size = spec["members"], spec["table_size"]
    table = maglev_table(members, spec["weights"], size)
    owned = maglev_owned(table)
    probe_keys = [0, 1, size - 1, size, 1 << 63, KEY_SPACE - 1, key(b"hello"), key(b"world")]
    vectors: dict[str, Any] = {
        **spec,
        "entries": {m: table.count(m) for m in members},
        "owned": {m: str(owned[m]) for m in members},
        "shares": {m: owned[m] / KEY_SPACE for m in members},
        "lookups": [
            {
                "key": str(k),
                "owner": table[k % size],
                "preference_2": maglev_preference(table, k, 2),
                "preference_all": maglev_preference(table, k, len(members)),
            }
            for k in sorted(set(probe_keys))
        ],
    }
    if size <= 64:
        vectors["table"] = table
    else:
        vectors["table_head"] = table[:16]
    return vectors


def pick_case(
    table: dict[str, str],
    text: str,
    loads: list[int],
    asked: dict[str, Any],
    factor: float,
    min_cap: int,
    chosen: tuple[str, str],
    why: str,
) -> dict[str, Any]:
    """One pick vector as golden.json lays it out: the table or ring, the key, the loads,
    what the pick was asked (replicas, homes), its cap, and the (member, branch) it chose."""
    member, branch = chosen
    return {
        **table,
        "key_of": text,
        "key": str(key(text.encode())),
        "loads": loads,
        **asked,
        "factor": factor,
        "min_cap": str(min_cap),
        "member": member,
        "branch": branch,
        "why": why,
    }


def maglev_pick_vectors() -> list[dict[str, Any]]:
    tables: dict[str, list[str]] = {}
    cases = []
    for spec, text, loads, replicas, homes, factor, min_cap, why in MAGLEV_PICK_CASES:
        members, weights = spec["members"], spec["weights"]
        if spec["name"] not in tables:
            tables[spec["name"]] = maglev_table(members, weights, spec["table_size"])
        table = tables[spec["name"]]
        k = key(text.encode())
        order = maglev_preference(table, k, len(members))
        home = order[:replicas] if homes is None else [members[i] for i in homes]
        chosen = bounded(members, weights, loads, home, order, factor, min_cap)
        asked = {"replicas": replicas, "homes": homes}
        cases.append(
            pick_case({"table": spec["name"]}, text, loads, asked, factor, min_cap, chosen, why)
        )
    return cases


def cost_pick_vectors() -> list[dict[str, Any]]:
    """Rule 5 with a request's cost u, over the rings and the Maglev tables alike."""
    tables: dict[str, list[str]] = {}
    cases = []
    for spec, text, loads, replicas, homes, factor, min_cap, u, why in COST_PICK_CASES:
        members, weights = spec["members"], spec["weights"]
        k = key(text.encode())
        if "table_size" in spec:
            if spec["name"] not in tables:
                tables[spec["name"]] = maglev_table(members, weights, spec["table_size"])
            order = maglev_preference(tables[spec["name"]], k, len(members))
            where = {"table": spec["name"]}
        else:
            order = preference(ring_points(members, weights, spec["vnodes"]), k, len(members))
            where = {"ring": spec["name"]}
        home = order[:replicas] if homes is None else [members[i] for i in homes]
        chosen = bounded(members, weights, loads, home, order, factor, min_cap, u)
        asked = {"replicas": replicas, "homes": homes, "cost": u}
        cases.append(pick_case(where, text, loads, asked, factor, min_cap, chosen, why))
    return cases


def pick_vectors() -> list[dict[str, Any]]:
    built: dict[str, list[tuple[int, str]]] = {}
    cases = []
    for spec, text, loads, replicas, factor, min_cap, why in PICK_CASES:
        name = spec["name"]
        if name not in built:
            built[name] = ring_points(spec["members"], spec["weights"], spec["vnodes"])
        k = key(text.encode())
        chosen = pick(
            built[name], spec["members"], spec["weights"], k, loads, replicas, factor, min_cap
        )
        asked = {"replicas": replicas}
        cases.append(pick_case({"ring": name}, text, loads, asked, factor, min_cap, chosen, why))
    return cases


def pick_among_vectors() -> list[dict[str, Any]]:
    cases = []
    for spec, text, loads, homes, factor, min_cap, why in PICK_AMONG_CASES:
        members = spec["members"]
        points = ring_points(members, spec["weights"], spec["vnodes"])
        k = key(text.encode())
        home = [members[i] for i in homes]
        chosen = pick_among(points, members, spec["weights"], k, loads, home, factor, min_cap)
        asked = {"homes": homes}
        cases.append(
            pick_case({"ring": spec["name"]}, text, loads, asked, factor, min_cap, chosen, why)
        )
    return cases


def placement_vectors() -> list[dict[str, Any]]:
    cases = []
    for spec, budget, balance, prefixes, why in PLACEMENT_CASES:
        members = spec["members"]
        points = ring_points(members, spec["weights"], spec["vnodes"])
        weights = dict(zip(members, spec["weights"], strict=True))
        items = [
            (key(t.encode()), tokens, r, hashlib.sha256(t.encode()).hexdigest())
            for t, tokens, r in prefixes
        ]
        homes = place(points, weights, items, budget, balance)
        homed = dict.fromkeys(members, 0)
        for _, tokens, _, prefix_id in items:
            for m in homes[prefix_id]:
                homed[m] += tokens
        cases.append(
            {
                "ring": spec["name"],
                "budget": budget,
                "balance": balance,
                "prefixes": [
                    {
                        "text": t,
                        "key": str(item[0]),
                        "id": item[3],
                        "tokens": tokens,
                        "replicas": r,
                        "homes": homes[item[3]],
                    }
                    for (t, tokens, r), item in zip(prefixes, items, strict=True)
                ],
                "homed_tokens": homed,
                "why": why,
            }
        )
    return cases


SYSTEM_PROMPT = (
    "You are the shopping assistant of store #7 (outdoor gear). Follow the store policy "
    "below. Coupons stack only with platform vouchers; never promise a delivery date. "
)
# (data, block bytes, max blocks, what the case shows)
CHAIN_CASES: list[tuple[bytes, int, int, str]] = [
    (b"", 64, 128, "empty: no block"),
    (b"x" * 63, 64, 128, "63 bytes: no full block"),
    (b"x" * 64, 64, 128, "one full block: key(8 zero bytes || block)"),
    (b"x" * 64 + b"y", 64, 128, "a partial tail block is not hashed"),
    (SYSTEM_PROMPT.encode() + b"Question: where is my parcel?", 64, 128, "a prompt, 64-B blocks"),
    (SYSTEM_PROMPT.encode() + b"Question: can I return it?", 64, 128, "same head, other question"),
    (SYSTEM_PROMPT.encode(), 64, 1, "max_blocks 1: the family key"),
    ("前缀缓存 prefix cache ✓ ".encode() * 3, 16, 128, "UTF-8 text, 16-byte blocks"),
]
SESSION_FAMILIES = ["tenant-7"]
SESSION_KEYS = ["session-a", "session-b", "session-c", "session-d"]
# (share, N, spread)
HOME_SIZE_CASES: list[tuple[float, int, float]] = [
    (0.0, 4, 2.0),
    (0.01, 4, 2.0),
    (0.125, 8, 2.0),
    (0.19, 4, 2.0),
    (0.19, 4, 3.0),
    (0.7, 4, 2.0),
    (0.01, 100, 2.0),
    (0.3, 100, 2.0),
    # the defaults: home set spread 4.0, session set spread 1.5 (9c, 9f)
    (0.0625, 4, 4.0),
    (0.07, 4, 4.0),
    (0.19, 4, 4.0),
    (0.19, 4, 1.5),
    (0.25, 8, 1.5),
    (0.26, 8, 1.5),
]
MESSAGE_CASES: list[list[tuple[str, str]]] = [
    [("system", SYSTEM_PROMPT), ("user", "where is my parcel?")],
    [
        ("system", SYSTEM_PROMPT),
        ("user", "where is my parcel?"),
        ("assistant", "It left the warehouse."),
        ("user", "when will it arrive?"),
    ],
    [("user", "前缀缓存 ✓")],
]


CHATML_TURNS = (
    "<|im_start|>system\nYou are the assistant of store #3.<|im_end|>\n"
    "<|im_start|>user\nwhere is my parcel?<|im_end|>\n"
    "<|im_start|>assistant\nIt left on Monday.<|im_end|>\n"
    "<|im_start|>user\nand the refund?<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_CASES: list[str] = [
    CHATML_TURNS,  # one answer and the generation prompt
    CHATML_TURNS[: CHATML_TURNS.rindex("<|im_start|>assistant")],  # no generation prompt
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nRules.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nMore<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",  # Llama 3
    "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
    "<start_of_turn>user\nMore<end_of_turn>\n<start_of_turn>model\n",  # Gemma
    "<s>[INST] Rules. Hi [/INST] Hello</s>[INST] More [/INST]",  # Mistral
    "<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\nMore<|end|>\n<|assistant|>\n",
    "  \n<|im_start|>user\nquoting <|start_header_id|>assistant<|end_header_id|><|im_end|>\n",
    "<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",  # no answer yet
    "Rules of the store. <|im_start|>assistant\n",  # not a rendered conversation
    # an answer longer than the tail: the header before it is not looked for
    CHATML_TURNS.replace("It left on Monday.", "Monday. " * 1050),
    # no header in the tail of a long prompt: nothing known
    "<|im_start|>user\n" + "question " * 950,
    "",
]


def organic_vectors() -> dict[str, Any]:
    chains = [
        {
            "data_hex": data.hex(),
            "block_bytes": block,
            "max_blocks": most,
            "keys": [str(k) for k in chain_keys(data, block, most)],
            "why": why,
        }
        for data, block, most, why in CHAIN_CASES
    ]
    homes = []
    rings: list[dict[str, Any]] = [RING_A, RING_B]
    for spec in rings:
        points = ring_points(spec["members"], spec["weights"], spec["vnodes"])
        for family in SESSION_FAMILIES:
            for size in sorted({1, 2, 3, len(spec["members"])}):
                for session in SESSION_KEYS:
                    f, k = key(family.encode()), key(session.encode())
                    member = session_home(points, f, size, k)
                    homes.append(
                        {
                            "ring": spec["name"],
                            "family_of": family,
                            "family": str(f),
                            "homes": size,
                            "session_of": session,
                            "session": str(k),
                            "member": member,
                            "index": spec["members"].index(member),
                        }
                    )
    return {
        "block_bytes": 64,
        "learn_blocks": 128,
        "learn_messages": 32,
        "chains": chains,
        "session_homes": homes,
        "home_sizes": [
            {"share": share, "members": n, "spread": spread, "size": home_size(share, n, spread)}
            for share, n, spread in HOME_SIZE_CASES
        ],
        "messages": [
            {"messages": [list(m) for m in case], "keys": [str(k) for k in message_keys(case, 32)]}
            for case in MESSAGE_CASES
        ],
        "turn_marks": [
            {"prompt": prompt, "marks": turn_marks(prompt)} for prompt in TEMPLATE_CASES
        ],
    }


def build() -> dict[str, Any]:
    return {
        "contract_version": CONTRACT_VERSION,
        "default_vnodes": CONTRACT_DEFAULT_VNODES,
        "note": (
            "generated by tests/core/make_golden.py; 64-bit values and min_cap are decimal strings"
        ),
        "keys": [{"data_hex": d.hex(), "key": str(key(d))} for d in KEY_INPUTS],
        "prefixes": [
            {
                "text": t,
                "utf8_hex": t.encode().hex(),
                "prefix_id": hashlib.sha256(t.encode()).hexdigest(),
                "route_key": str(key(t.encode())),
            }
            for t in PREFIX_TEXTS
        ],
        "rings": [ring_vectors(RING_A), ring_vectors(RING_B)],
        "picks": pick_vectors(),
        "picks_among": pick_among_vectors(),
        "placements": placement_vectors(),
        "maglev_default_table_size": CONTRACT_DEFAULT_TABLE_SIZE,
        "maglevs": [maglev_vectors(MAGLEV_A), maglev_vectors(MAGLEV_B)],
        "maglev_picks": maglev_pick_vectors(),
        "cost_picks": cost_pick_vectors(),
        "organic": organic_vectors(),
    }


def render() -> str:
    return json.dumps(build(), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    GOLDEN_PATH.write_text(render(), encoding="utf-8")
    print(f"wrote {GOLDEN_PATH}")
