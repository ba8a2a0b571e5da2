"""Routing contract v1, pure Python: the readable, typed twin of `prefix_sidecar._core_c`.

Every function here has a Cython twin in csrc/_core_c.pyx that must return the same result
to the bit; docs/routing-contract.md is the specification both follow, and
tests/core/ holds golden vectors and a hypothesis test that keep them identical.

Algorithm: a consistent-hash ring (libketama-style points, `vnodes` per unit of weight,
MurmurHash3 x64-128 keys), built once per membership change and queried by binary search;
`pick` adds bounded-load spill (Mirrokni et al., "Consistent Hashing with Bounded Loads")
over a replica set of the first R distinct owners, with an optional floor on each cap.
A Maglev table (Eisenbud et al., NSDI 2016) is the other routing table (section 8): owner
is one modulo, and preference walks on through its entries; pick is the same code over it.
Complexity: ring build O(P log P) for P points, Maglev build O(M log N) for M entries;
owner O(log P) (ring) or O(1) (Maglev); preference(n) O(steps walked); pick O(N) for the
load sum plus the walk, or, with the loads' total given, O(R) when a home fits and
O(steps walked) when it spills.
"""

from __future__ import annotations

import array
import hashlib
import heapq
import math
import operator
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

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
# A request's weight in a pick (routing contract 4: u; 1 when load counts requests).
MAX_COST = 1 << 40

# Routing contract section 8: the Maglev table size, prime (Envoy's default); at most 2**24.
DEFAULT_TABLE_SIZE = 65537
MAX_TABLE_SIZE = 1 << 24
HASH_TABLES = ("ring", "maglev")

# Organic routing (routing contract section 9): block chain hashing of unregistered prompts.
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
    """Chained keys of the full blocks of `data` (routing contract 9a), vLLM style:
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


def check_cost(cost: object) -> int:
    """Validate a request's cost: an int in 1..MAX_COST (1: load counted in requests)."""
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise TypeError(f"cost must be an int >= 1, got {type(cost).__name__}")
    if not 1 <= cost <= MAX_COST:
        raise ValueError(f"cost is {cost}; a request's cost must be in 1..{MAX_COST}")
    return cost


def check_cost_room(total: int, cost: int) -> None:
    """The loads' total plus the request's cost must fit in int64 (both twins compute it)."""
    if total > MAX_TOTAL_LOAD + 1 - cost:
        raise ValueError(
            f"the loads total {total} plus the cost {cost} is over 2**63 - 1; "
            "count load in larger units"
        )


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


def cap(
    factor: float,
    total_load: int,
    weight: int,
    total_weight: int,
    min_cap: int = 0,
    cost: int = 1,
) -> float:
    """cap(m) = max(min_cap, ceil(c * (total_load + cost) * w_m / W)), the ceil in IEEE-754
    doubles, in that order; a member fits when load + cost <= cap.

    A float, because a huge factor overflows the double to +inf (an unbounded cap); the
    caller's `load + cost <= cap` compares an int with a float, which Python does exactly. When
    the floor wins it is returned as the int itself: as a double it could lose its low bits
    above 2**53.
    """
    limit = factor * float(total_load + cost) * float(weight) / float(total_weight)
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


class _Table:
    """What the ring and the Maglev table share: a cycle of member indexes (`_owners`), where
    a key enters it (`_start`), and everything answered by walking it from there."""

    __slots__ = ("_owners", "members", "total_weight", "weights")

    members: tuple[str, ...]
    weights: tuple[int, ...]
    total_weight: int
    _owners: list[int]

    def __len__(self) -> int:
        return len(self.members)

    def _start(self, key: int) -> int:
        raise NotImplementedError

    def _distinct(self, start: int) -> Iterator[int]:
        """Each member once, in the order first met walking the cycle from `start`. Every
        member is on the cycle, so the walk ends after all of them."""
        owners = self._owners
        size = len(owners)
        count = len(self.members)
        seen: set[int] = set()
        position = start
        while True:
            member = owners[position]
            if member not in seen:
                seen.add(member)
                yield member
                if len(seen) == count:
                    return
            position += 1
            if position == size:
                position = 0

    def owner(self, key: int) -> str:
        """The member the key lands on."""
        return self.members[self._owners[self._start(check_key(key))]]

    def preference(self, key: int, n: int) -> list[str]:
        """The first n distinct members walking on from owner(key), owner first."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n is {n}; ask for at least 1 member")
        walk = self._distinct(self._start(check_key(key)))
        # At most every member, as the extension (islice refuses n over sys.maxsize).
        return [self.members[i] for i in islice(walk, min(n, len(self.members)))]

    def pick(
        self,
        key: int,
        loads: Sequence[int],
        replicas: int = 1,
        factor: float = 1.25,
        min_cap: int = 0,
        total: int | None = None,
        cost: int = 1,
    ) -> tuple[str, str]:
        """Bounded-load pick over the replica set; returns (member, branch).

        `min_cap` floors every member's cap: below that many requests in flight a member
        always fits, so a hot prefix stays on its warm home pod at low traffic. `total`, when
        given, must be sum(loads) (the caller's invariant, contract section 4): the pick then
        reads only the loads it needs instead of summing them all. `cost` is what the request
        adds to a load (1 in requests; its tokens when load is counted in tokens).
        """
        replicas, factor, min_cap = check_pick_args(replicas, factor, min_cap)
        cost = check_cost(cost)
        return self._pick_from(check_key(key), loads, replicas, factor, min_cap, total, cost)

    def pick_bytes(
        self,
        data: bytes,
        loads: Sequence[int],
        replicas: int = 1,
        factor: float = 1.25,
        min_cap: int = 0,
        total: int | None = None,
        cost: int = 1,
    ) -> tuple[str, str, int]:
        """pick(route_key(data), ...) in one call; returns (member, branch, key)."""
        replicas, factor, min_cap = check_pick_args(replicas, factor, min_cap)
        cost = check_cost(cost)
        key = route_key(data)
        member, branch = self._pick_from(key, loads, replicas, factor, min_cap, total, cost)
        return member, branch, key

    def _pick_from(
        self,
        key: int,
        loads: Sequence[int],
        replicas: int,
        factor: float,
        min_cap: int,
        total: int | None,
        cost: int,
    ) -> tuple[str, str]:
        """pick and pick_bytes once the parameters and the key are checked."""
        start = self._start(key)
        values, total, given = self._loads(loads, total)
        check_cost_room(total, cost)
        home = list(islice(self._distinct(start), replicas))
        return self._choose(start, values, total, given, home, factor, min_cap, cost)

    def pick_among(
        self,
        key: int,
        loads: Sequence[int],
        homes: Sequence[int],
        factor: float = 1.25,
        min_cap: int = 0,
        total: int | None = None,
        cost: int = 1,
    ) -> tuple[str, str]:
        """pick with an explicit home set instead of the first R owners (contract 4b).

        `homes` are member indexes into `members` (a budgeted placement's home set, say),
        the earlier one winning ties; the spill walk is pick's, from `key`.
        """
        _, factor, min_cap = check_pick_args(1, factor, min_cap)
        cost = check_cost(cost)
        home = check_homes(homes, len(self.members))
        start = self._start(check_key(key))
        values, total, given = self._loads(loads, total)
        check_cost_room(total, cost)
        return self._choose(start, values, total, given, home, factor, min_cap, cost)

    def _loads(self, loads: Sequence[int], total: int | None) -> tuple[Sequence[int], int, bool]:
        """(loads, their total, whether the total was given). Summing checks every load;
        a given total is checked alone, and each load when `_choose` reads it."""
        if total is None:
            values, total = self._checked_loads(loads)
            return values, total, False
        if isinstance(loads, array.array) and loads.typecode == "q":
            given: Sequence[int] = loads  # read in place, as the Cython twin borrows it
        else:
            given = _int64_loads(loads)  # copied once, as the Cython twin does
        total = check_total(total)
        self._check_length(len(given))
        return given, total, True

    def _check_length(self, length: int) -> None:
        count = len(self.members)
        if length != count:
            raise ValueError(
                f"loads has {length} entries for {count} members; "
                "give one load per member, aligned with ring.members"
            )

    def _checked_loads(self, loads: Sequence[int]) -> tuple[list[int], int]:
        values = _int64_loads(loads)
        self._check_length(len(values))
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
        start: int,
        loads: Sequence[int],
        total: int,
        given: bool,
        home: list[int],
        factor: float,
        min_cap: int,
        cost: int = 1,
    ) -> tuple[str, str]:
        """The least-loaded home member if it fits its cap, else the spill walk: O(R) reads
        when the home fits, and the walk stops at the first member that fits."""

        def load_of(member: int) -> int:
            load = loads[member]
            if given:
                _check_given_load(load, member, total)
            return load

        weights = self.weights
        total_weight = self.total_weight
        chosen = home[0]
        least_load = load_of(chosen)
        for member in home[1:]:
            load = load_of(member)
            if load < least_load:
                chosen, least_load = member, load
        if least_load + cost <= cap(factor, total, weights[chosen], total_weight, min_cap, cost):
            return self.members[chosen], BRANCH_HOME
        least = -1
        for member in self._distinct(start):
            load = load_of(member)
            if least < 0 or load < least_load:
                least, least_load = member, load
            if member != chosen and load + cost <= cap(
                factor, total, weights[member], total_weight, min_cap, cost
            ):
                return self.members[member], BRANCH_SPILL
        return self.members[least], BRANCH_FALLBACK

    def session_home(self, family: int, homes: int, session: int) -> int:
        """The index of the first member of preference(session, N) that is one of
        preference(family, homes) (routing contract 9b): consistent hashing of the session
        key restricted to the family's home set, so growing the set moves few sessions.
        Written on the preference walk, so a Maglev table answers it the same way."""
        if isinstance(homes, bool) or not isinstance(homes, int):
            raise TypeError(f"homes must be an int, got {type(homes).__name__}")
        if homes < 1:
            raise ValueError(f"homes is {homes}; a home set has at least 1 member")
        # At most every member, as the extension (islice refuses homes over sys.maxsize).
        walk = self._distinct(self._start(check_key(family)))
        home = set(islice(walk, min(homes, len(self.members))))
        owners = self._owners
        position = self._start(check_key(session))
        while owners[position] not in home:
            position += 1
            if position == len(owners):
                position = 0
        return owners[position]


def _check_given_load(load: int, member: int, total: int) -> None:
    """With a given total, each load read is checked against it (the caller's invariant)."""
    if load < 0:
        raise ValueError(f"load {load} is negative; loads are in-flight request counts")
    if load > total:
        raise ValueError(
            f"load {load} of member {member} is above the given total {total}; "
            "total must be sum(loads)"
        )


def check_total(total: object) -> int:
    """Validate a given loads total: an int in 0..2**63 - 2 (the caller keeps it = sum(loads))."""
    if isinstance(total, bool) or not isinstance(total, int):
        raise TypeError(
            f"total must be an int (the sum of the loads) or None, got {type(total).__name__}"
        )
    if not 0 <= total <= MAX_TOTAL_LOAD:
        raise ValueError(f"total is {total}; it must be sum(loads), in 0..{MAX_TOTAL_LOAD}")
    return total


class Ring(_Table):
    """An immutable consistent-hash ring; build a new one when membership changes."""

    __slots__ = ("_points", "vnodes")

    vnodes: int

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

    def __repr__(self) -> str:
        return f"Ring({len(self.members)} members, {len(self._points)} points)"

    def _start(self, key: int) -> int:
        index = bisect_left(self._points, key)
        return 0 if index == len(self._points) else index

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


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, math.isqrt(n) + 1))


def check_table_size(table_size: object, count: int) -> int:
    """Validate a Maglev table size: a prime M with N <= M <= MAX_TABLE_SIZE."""
    if isinstance(table_size, bool) or not isinstance(table_size, int):
        raise TypeError(f"table_size must be an int, got {type(table_size).__name__}")
    if not count <= table_size <= MAX_TABLE_SIZE:
        raise ValueError(
            f"table_size is {table_size}; it must be at least the member count ({count}) and "
            f"at most {MAX_TABLE_SIZE} (and about 100x the member count for balance)"
        )
    if not _is_prime(table_size):
        raise ValueError(f"table_size {table_size} is not prime; Maglev needs a prime (65537)")
    return table_size


def maglev_fill(members: tuple[str, ...], weights: tuple[int, ...], table_size: int) -> list[int]:
    """Routing contract section 8: the Maglev lookup table (member indexes), weighted.

    Members take entries in turn, in code-point order of their ids: the k-th entry of a member
    of weight w is due in round ceil(k * max_w / w), rounds in order and, within a round,
    members in that order; each takes the first empty entry of its permutation
    offset, offset + skip, offset + 2 * skip, ... (mod M), from where it stopped last time.
    A heap of (round, rank) yields that order in O(M log N), whatever the weights.
    """
    size = table_size
    ranked = sorted(range(len(members)), key=lambda i: members[i])
    max_weight = max(weights)
    offsets, skips = [], []
    for index in ranked:
        name = members[index].encode("utf-8")
        offsets.append(mmh3.hash64(name, seed=0, signed=False)[0] % size)
        skips.append(mmh3.hash64(name, seed=1, signed=False)[0] % (size - 1) + 1)
    tried = [0] * len(ranked)  # j: how far along its permutation each member has looked
    owned = [0] * len(ranked)  # k: entries each member has taken
    table = [-1] * size
    heap = [(-(-max_weight // weights[index]), rank) for rank, index in enumerate(ranked)]
    heapq.heapify(heap)
    for _ in range(size):
        _, rank = heapq.heappop(heap)
        skip = skips[rank]
        j = tried[rank]
        entry = (offsets[rank] + j * skip) % size
        while table[entry] >= 0:
            j += 1
            entry += skip
            if entry >= size:
                entry -= size
        index = ranked[rank]
        table[entry] = index
        tried[rank] = j + 1
        owned[rank] += 1
        due = -(-(owned[rank] + 1) * max_weight // weights[index])  # ceil((k + 1) * max_w / w)
        heapq.heappush(heap, (due, rank))
    for rank, index in enumerate(ranked):
        if owned[rank] == 0:
            raise ValueError(
                f"member {members[index]!r} got no entry of the {size}-entry Maglev table: "
                "its weight is too small next to the others'; raise table_size or its weight"
            )
    return table


class Maglev(_Table):
    """A Maglev lookup table (Eisenbud et al., NSDI 2016), weighted as Envoy's: owner(k) is
    entry k mod M, O(1); the preference order walks on through the entries (section 8)."""

    __slots__ = ("table_size",)

    table_size: int

    def __init__(
        self,
        members: Iterable[str],
        weights: Sequence[int] | None = None,
        table_size: int = DEFAULT_TABLE_SIZE,
    ) -> None:
        # One "point" per unit of weight: the members' checks without the ring's point budget.
        self.members, self.weights = _check_members(members, weights, 1)
        self.table_size = check_table_size(table_size, len(self.members))
        self.total_weight = sum(self.weights)
        self._owners = maglev_fill(self.members, self.weights, self.table_size)

    def __repr__(self) -> str:
        return f"Maglev({len(self.members)} members, {self.table_size} entries)"

    def _start(self, key: int) -> int:
        return key % self.table_size

    def shares(self) -> dict[str, float]:
        """The exact fraction of the 2**64 key space each member owns: entry e holds the
        keys k with k mod M == e."""
        each, extra = divmod(KEY_SPACE, self.table_size)
        owned = [0] * len(self.members)
        for entry, member in enumerate(self._owners):
            owned[member] += each + (1 if entry < extra else 0)
        return {member: owned[i] / KEY_SPACE for i, member in enumerate(self.members)}

    def table(self) -> list[str]:
        """The member of every entry, in entry order: for golden vectors and debugging."""
        return [self.members[m] for m in self._owners]


HashTable = _Table  # what a routing table is, to its users: a Ring or a Maglev


def make_table(
    kind: str, members: Iterable[str], weights: Sequence[int] | None, vnodes: int
) -> _Table:
    """The routing table a fleet chose (config `hash_table`): "ring" or "maglev"."""
    if kind == "ring":
        return Ring(members, weights, vnodes)
    if kind == "maglev":
        return Maglev(members, weights)
    raise ValueError(f"unknown hash table {kind!r}; choose one of {', '.join(HASH_TABLES)}")
