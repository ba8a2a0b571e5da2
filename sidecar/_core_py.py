"""Routing contract v1, pure Python: the readable, typed twin of `sidecar._core_c`.

Every function here has a Cython twin in csrc/_core_c.pyx that must return the same result
to the bit; docs/routing-contract.md is the specification both follow, and
tests/core/ holds golden vectors and a hypothesis test that keep them identical.

Algorithm: a consistent-hash ring (libketama-style points, `vnodes` per unit of weight,
MurmurHash3 x64-128 keys), built once per membership change and queried by binary search;
`pick` adds bounded-load spill (Mirrokni et al., "Consistent Hashing with Bounded Loads")
over a replica set of the first R distinct owners, with an optional floor on each cap.
Complexity: build O(P log P) for P points; owner O(log P); preference(n) O(steps walked),
about n * P/N * ln(N) in the worst case; pick O(N) for the load sum plus the walk.
"""

from __future__ import annotations

import array
import hashlib
import math
import operator
from bisect import bisect_left
from collections.abc import Iterable, Sequence

import mmh3

# At 100 equal pods this keeps the busiest pod's exact key-space share within 1.10x the mean
# (measured in tests/core/test_balance.py); docs/mission.md's 3 points per pod gives about 2x.
DEFAULT_VNODES = 1024

KEY_SPACE = 1 << 64
MAX_KEY = KEY_SPACE - 1
MAX_WEIGHT = 1 << 16
MAX_POINTS = 1 << 24
# Loads are int64 (the Cython twin reads them as array('q')); their total + 1 must fit too.
MAX_TOTAL_LOAD = (1 << 63) - 2

# Organic routing (routing contract section 8): block chain hashing of unregistered prompts.
MAX_BLOCK_BYTES = 1 << 16

BRANCH_HOME = "home"
BRANCH_SPILL = "spill"
BRANCH_FALLBACK = "fallback"


def route_key(data: bytes) -> int:
    """key(data): the first 64-bit word of MurmurHash3_x64_128(data, seed=0), unsigned."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"route_key() needs bytes, got {type(data).__name__}; encode text as UTF-8 first"
        )
    return int(mmh3.hash64(bytes(data), seed=0, signed=False)[0])


def prefix_id(text: str) -> str:
    """A prefix's id: the lowercase hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(_utf8(text, "prefix_id")).hexdigest()


def prefix_route_key(text: str) -> int:
    """A prefix's route key: key() of its UTF-8 bytes."""
    return route_key(_utf8(text, "prefix_route_key"))


def check_chain_args(data: object, block_bytes: object, max_blocks: object) -> None:
    """Validate chain_keys' arguments (both twins raise the first error alike)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"chain_keys() needs bytes, got {type(data).__name__}; encode text as UTF-8 first"
        )
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int):
        raise TypeError(f"block_bytes must be an int, got {type(block_bytes).__name__}")
    if not 1 <= block_bytes <= MAX_BLOCK_BYTES:
        raise ValueError(f"block_bytes is {block_bytes}; it must be in 1..{MAX_BLOCK_BYTES}")
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int):
        raise TypeError(f"max_blocks must be an int, got {type(max_blocks).__name__}")
    if max_blocks < 0:
        raise ValueError(f"max_blocks is {max_blocks}; it must be >= 0")


def chain_keys(data: bytes, block_bytes: int, max_blocks: int) -> list[int]:
    """Chained keys of the full blocks of `data` (routing contract 8a), vLLM style:
    c_i = key(le64(c_{i-1}) || block_i), c_{-1} = 0, for the first min(len // B, max_blocks)
    blocks. Two prompts share c_i only if they share their first (i + 1) * B bytes."""
    check_chain_args(data, block_bytes, max_blocks)
    raw = bytes(data)
    count = min(len(raw) // block_bytes, max_blocks)
    keys: list[int] = []
    parent = 0
    hash64 = mmh3.hash64
    for start in range(0, count * block_bytes, block_bytes):
        block = parent.to_bytes(8, "little") + raw[start : start + block_bytes]
        parent = int(hash64(block, seed=0, signed=False)[0])
        keys.append(parent)
    return keys


def _utf8(text: str, where: str) -> bytes:
    if not isinstance(text, str):
        raise TypeError(f"{where}() needs str, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where}(): text is not valid UTF-8 (character at {exc.start} is a lone surrogate)"
        ) from None


def check_key(key: object) -> int:
    """Validate a route key: an int in [0, 2**64)."""
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"key must be an int in [0, 2**64), got {type(key).__name__}")
    if not 0 <= key <= MAX_KEY:
        raise ValueError(f"key {key} is out of range; keys are unsigned 64-bit: [0, 2**64)")
    return key


def _check_members(
    members: Iterable[str], weights: Sequence[int] | None, vnodes: int
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if isinstance(members, (str, bytes)):
        raise TypeError("members must be a sequence of member ids, not a single string")
    member_tuple = tuple(members)
    if not member_tuple:
        raise ValueError("a ring needs at least one member; the member list is empty")
    seen: set[str] = set()
    for index, member in enumerate(member_tuple):
        if not isinstance(member, str):
            raise TypeError(f"member {index} must be a str id, got {type(member).__name__}")
        if not member:
            raise ValueError(f"member {index} is an empty string; use the pod's canonical URL")
        if member in seen:
            raise ValueError(f"duplicate member {member!r}; each member may appear once")
        seen.add(member)
    if weights is None:
        weight_tuple = (1,) * len(member_tuple)
    else:
        if isinstance(weights, (str, bytes)):
            raise TypeError("weights must be a sequence of ints")
        weight_tuple = tuple(weights)
        if len(weight_tuple) != len(member_tuple):
            raise ValueError(
                f"got {len(weight_tuple)} weights for {len(member_tuple)} members; "
                "give one weight per member"
            )
        for member, weight in zip(member_tuple, weight_tuple, strict=False):
            if isinstance(weight, bool) or not isinstance(weight, int):
                raise TypeError(f"weight of {member!r} must be an int, got {type(weight).__name__}")
            if not 1 <= weight <= MAX_WEIGHT:
                raise ValueError(
                    f"weight of {member!r} is {weight}; weights must be in 1..{MAX_WEIGHT}"
                )
    if isinstance(vnodes, bool) or not isinstance(vnodes, int):
        raise TypeError(f"vnodes must be an int, got {type(vnodes).__name__}")
    if vnodes < 1:
        raise ValueError(f"vnodes is {vnodes}; each member needs at least 1 point per weight unit")
    if vnodes * sum(weight_tuple) > MAX_POINTS:
        raise ValueError(
            f"vnodes * total weight = {vnodes * sum(weight_tuple)} points exceeds {MAX_POINTS}; "
            "lower vnodes or the weights"
        )
    return member_tuple, weight_tuple


def check_pick_args(
    replicas: object, factor: object, min_cap: object = 0
) -> tuple[int, float, int]:
    """Validate pick's parameters in this order (both twins raise the first error alike)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise TypeError(f"replicas must be an int, got {type(replicas).__name__}")
    if replicas < 1:
        raise ValueError(f"replicas is {replicas}; it must be >= 1")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"factor must be a float, got {type(factor).__name__}")
    factor = float(factor)
    if not factor >= 1.0 or math.isinf(factor):
        raise ValueError(
            f"factor is {factor}; the bounded-load factor must be a finite value >= 1.0"
        )
    return replicas, factor, check_min_cap(min_cap)


def check_min_cap(min_cap: object) -> int:
    """Validate the load-cap floor: an int >= 0 (0: no floor, the original formula)."""
    if isinstance(min_cap, bool) or not isinstance(min_cap, int):
        raise TypeError(f"min_cap must be an int >= 0, got {type(min_cap).__name__}")
    if min_cap < 0:
        raise ValueError(f"min_cap is {min_cap}; the load-cap floor must be >= 0 (0: no floor)")
    return min_cap


def check_homes(homes: object, count: int) -> list[int]:
    """Validate an explicit home set: 1..count distinct member indexes in [0, count)."""
    if isinstance(homes, (str, bytes, bytearray)) or not isinstance(homes, Iterable):
        raise TypeError(f"homes must be a sequence of member indexes, not {type(homes).__name__}")
    result: list[int] = []
    for index in homes:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"homes holds a {type(index).__name__}; give member indexes (ints)")
        if not 0 <= index < count:
            raise ValueError(f"home index {index} is outside the ring's members 0..{count - 1}")
        if index in result:
            raise ValueError(f"home index {index} appears twice; a home set has distinct members")
        result.append(index)
    if not result:
        raise ValueError("homes is empty; give at least one member index")
    return result


def cap(factor: float, total_load: int, weight: int, total_weight: int, min_cap: int = 0) -> float:
    """cap(m) = max(min_cap, ceil(c * (total_load + 1) * w_m / W)), the ceil in IEEE-754
    doubles, in that order.

    A float, because a huge factor overflows the double to +inf (an unbounded cap); the
    caller's `load + 1 <= cap` compares an int with a float, which Python does exactly. When
    the floor wins it is returned as the int itself: as a double it could lose its low bits
    above 2**53.
    """
    limit = factor * float(total_load + 1) * float(weight) / float(total_weight)
    if not math.isinf(limit):
        limit = float(math.ceil(limit))
    return min_cap if min_cap > limit else limit


def _int64_loads(loads: Iterable[int]) -> list[int]:
    """Loads as the Cython twin reads them, array('q')-style: ints (or __index__), int64."""
    if isinstance(loads, (str, bytes, bytearray)):
        raise TypeError(
            f"loads must be a sequence of ints or an array('q'), not {type(loads).__name__}"
        )
    if isinstance(loads, array.array) and loads.typecode == "q":
        return loads.tolist()
    values = list(map(operator.index, loads))
    if values and (min(values) < -(1 << 63) or max(values) >= 1 << 63):
        raise ValueError("a load is out of the signed 64-bit range")
    return values


class Ring:
    """An immutable consistent-hash ring; build a new one when membership changes."""

    __slots__ = ("_owners", "_points", "members", "total_weight", "vnodes", "weights")

    members: tuple[str, ...]
    weights: tuple[int, ...]
    vnodes: int
    total_weight: int

    def __init__(
        self,
        members: Iterable[str],
        weights: Sequence[int] | None = None,
        vnodes: int = DEFAULT_VNODES,
    ) -> None:
        self.members, self.weights = _check_members(members, weights, vnodes)
        self.vnodes = vnodes
        self.total_weight = sum(self.weights)
        entries = []
        for index, (member, weight) in enumerate(zip(self.members, self.weights, strict=False)):
            for i in range(vnodes * weight):
                point = mmh3.hash64(f"{member}#{i}".encode(), seed=0, signed=False)[0]
                entries.append((point, member, index))
        entries.sort()
        self._points = [entry[0] for entry in entries]
        self._owners = [entry[2] for entry in entries]

    def __len__(self) -> int:
        return len(self.members)

    def __repr__(self) -> str:
        return f"Ring({len(self.members)} members, {len(self._points)} points)"

    def _start(self, key: object) -> int:
        index = bisect_left(self._points, check_key(key))
        return 0 if index == len(self._points) else index

    def owner(self, key: int) -> str:
        """The member of the first point >= key, wrapping to the first point."""
        return self.members[self._owners[self._start(key)]]

    def _walk(self, key: object, n: int) -> list[int]:
        """Indexes of the first n distinct members clockwise from owner(key)."""
        start = self._start(key)
        n = min(n, len(self.members))
        found: list[int] = []
        seen = [False] * len(self.members)
        owners = self._owners
        size = len(owners)
        position = start
        while len(found) < n:
            member = owners[position]
            if not seen[member]:
                seen[member] = True
                found.append(member)
            position += 1
            if position == size:
                position = 0
        return found

    def preference(self, key: int, n: int) -> list[str]:
        """The first n distinct members walking clockwise from owner(key), owner first."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n is {n}; ask for at least 1 member")
        return [self.members[i] for i in self._walk(key, n)]

    def pick(
        self,
        key: int,
        loads: Sequence[int],
        replicas: int = 1,
        factor: float = 1.25,
        min_cap: int = 0,
    ) -> tuple[str, str]:
        """Bounded-load pick over the replica set; returns (member, branch).

        `min_cap` floors every member's cap: below that many requests in flight a member
        always fits, so a hot prefix stays on its warm home pod at low traffic.
        """
        replicas, factor, min_cap = check_pick_args(replicas, factor, min_cap)
        check_key(key)
        values, total = self._checked_loads(loads)
        return self._choose(key, values, total, self._walk(key, replicas), factor, min_cap)

    def pick_among(
        self,
        key: int,
        loads: Sequence[int],
        homes: Sequence[int],
        factor: float = 1.25,
        min_cap: int = 0,
    ) -> tuple[str, str]:
        """pick with an explicit home set instead of the first R owners (contract 4b).

        `homes` are member indexes into `members` (a budgeted placement's home set, say),
        the earlier one winning ties; the spill walk is pick's, clockwise from `key`.
        """
        _, factor, min_cap = check_pick_args(1, factor, min_cap)
        home = check_homes(homes, len(self.members))
        check_key(key)
        values, total = self._checked_loads(loads)
        return self._choose(key, values, total, home, factor, min_cap)

    def _checked_loads(self, loads: Sequence[int]) -> tuple[list[int], int]:
        values = _int64_loads(loads)
        count = len(self.members)
        if len(values) != count:
            raise ValueError(
                f"loads has {len(values)} entries for {count} members; "
                "give one load per member, aligned with ring.members"
            )
        total = 0
        for load in values:
            if load < 0:
                raise ValueError(f"load {load} is negative; loads are in-flight request counts")
            total += load
            if total > MAX_TOTAL_LOAD:
                raise ValueError(f"the loads sum to more than {MAX_TOTAL_LOAD} (2**63 - 2)")
        return values, total

    def _choose(
        self,
        key: int,
        loads: list[int],
        total: int,
        home: list[int],
        factor: float,
        min_cap: int,
    ) -> tuple[str, str]:
        """The least-loaded home member if it fits its cap, else the spill walk."""
        weights = self.weights
        chosen = home[0]
        for member in home[1:]:
            if loads[member] < loads[chosen]:
                chosen = member
        total_weight = self.total_weight
        if loads[chosen] + 1 <= cap(factor, total, weights[chosen], total_weight, min_cap):
            return self.members[chosen], BRANCH_HOME
        order = self._walk(key, len(self.members))
        for member in order:
            if member != chosen and loads[member] + 1 <= cap(
                factor, total, weights[member], total_weight, min_cap
            ):
                return self.members[member], BRANCH_SPILL
        least = order[0]
        for member in order[1:]:
            if loads[member] < loads[least]:
                least = member
        return self.members[least], BRANCH_FALLBACK

    def session_home(self, family: int, homes: int, session: int) -> int:
        """The index of the first member of preference(session, N) that is one of
        preference(family, homes) (routing contract 8b): consistent hashing of the session
        key restricted to the family's home set, so growing the set moves few sessions."""
        if isinstance(homes, bool) or not isinstance(homes, int):
            raise TypeError(f"homes must be an int, got {type(homes).__name__}")
        if homes < 1:
            raise ValueError(f"homes is {homes}; a home set has at least 1 member")
        check_key(family)
        check_key(session)
        home = set(self._walk(family, homes))
        owners = self._owners
        position = self._start(session)
        while owners[position] not in home:
            position = (position + 1) % len(owners)
        return owners[position]

    def shares(self) -> dict[str, float]:
        """The exact fraction of the 2**64 key space each member owns."""
        owned = [0] * len(self.members)
        points = self._points
        previous = points[-1] - KEY_SPACE  # the wrap-around arc belongs to the first point
        for point, member in zip(points, self._owners, strict=False):
            owned[member] += point - previous
            previous = point
        return {member: owned[i] / KEY_SPACE for i, member in enumerate(self.members)}

    def points(self) -> list[tuple[int, str]]:
        """The sorted (point, member) list: for golden vectors and debugging."""
        return [(p, self.members[m]) for p, m in zip(self._points, self._owners, strict=False)]
