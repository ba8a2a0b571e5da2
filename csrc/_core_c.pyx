# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Routing contract v1, compiled: the fast twin of prefix_sidecar/_core_py.py.

Same API and results to the bit (docs/routing-contract.md, tests/core/). The ring is built once
per membership change, Envoy ring_hash style: points are hashed and sorted in C, then a bucket
index on the top bits of the key makes owner() a short search inside one bucket instead of a
binary search over the whole ring. Validation of construction arguments is shared with the
twin (it is not hot); everything on the per-request path is checked here, in C.
"""

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.float cimport DBL_MAX
from libc.math cimport ceil
from libc.stdint cimport INT64_MAX, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport calloc, free, malloc, qsort
from libc.string cimport memcpy, memset

import array
import hashlib

from prefix_sidecar._core_py import (
    BRANCH_FALLBACK,
    BRANCH_HOME,
    BRANCH_SPILL,
    DEFAULT_TABLE_SIZE,
    DEFAULT_VNODES,
    HASH_TABLES,
    MAX_BLOCK_BYTES,
    MAX_COST,
    MAX_TOTAL_LOAD,
    _check_given_load,
    _check_members,
    _utf8,
    check_chain_args,
    check_cost,
    check_cost_room,
    check_homes,
    check_key,
    check_pick_args,
    check_table_size,
    check_total,
)

cdef extern from *:
    void __builtin_prefetch(const void *address) nogil

cdef extern from *:
    """
    #include <stdlib.h>
    #include <sys/mman.h>
    /* A ring of thousands of pods is tens of MB read at random: on 4 KB pages nearly every
       lookup also misses the TLB. Ask Linux for transparent huge pages (THP "madvise" mode)
       for big arrays; elsewhere, or if refused, it is plain memory. Freed with free(). */
    static void *ps_alloc_big(size_t bytes) {
    #if defined(MADV_HUGEPAGE)
        const size_t huge = (size_t)2 << 20;
        if (bytes >= huge) {
            void *p = NULL;
            if (posix_memalign(&p, huge, bytes) != 0) return NULL;
            madvise(p, bytes, MADV_HUGEPAGE);
            return p;
        }
    #endif
        return malloc(bytes);
    }
    """
    void *ps_alloc_big(size_t bytes) nogil

cdef extern from *:
    """
    /* sum(loads) if every load is >= 0 and the sum <= 2**63 - 2: 1, and *total set; else 0.
       The low and high 32 bits of the loads are summed apart, in 64 bits (neither can wrap
       for fewer than 2**32 loads), so the loop has no branch and the compiler vectorizes it. */
    static int ps_sum_loads(const int64_t *loads, uint32_t count, int64_t *total) {
        uint64_t low = 0, high = 0;
        int64_t sign = 0;
        for (uint32_t i = 0; i < count; i++) {
            sign |= loads[i];
            low += (uint64_t)loads[i] & 0xFFFFFFFFu;
            high += (uint64_t)loads[i] >> 32;
        }
        /* sum = high * 2**32 + low <= 2**63 - 2, without overflowing: high < 2**31 bounds
           high * 2**32 to 2**63 - 2**32, and low must fit in what is left. */
        if (sign < 0 || high > ((uint64_t)INT64_MAX - 1) >> 32) return 0;
        if (low > (uint64_t)INT64_MAX - 1 - (high << 32)) return 0;
        *total = (int64_t)((high << 32) + low);
        return 1;
    }
    """
    bint ps_sum_loads(const int64_t *loads, uint32_t count, int64_t *total) noexcept nogil

cdef extern from "murmur3.h":
    uint64_t ps_murmur3_x64_128_h1(const void *key, size_t length, uint32_t seed) nogil

# Hashing a whole fat prompt (240 KB) takes tens of microseconds: let other threads run.
cdef size_t RELEASE_GIL_BYTES = 65536
# Bucket index size: about one bucket per point, at most 2**20 buckets (4 MiB).
cdef int MAX_INDEX_BITS = 20
# An entry of the Maglev table not filled yet (member indexes are < 2**32 - 1).
cdef uint32_t EMPTY_ENTRY = 0xFFFFFFFFU
# A request's largest cost in a pick, read once from the twin (routing contract 4: u).
cdef int64_t COST_LIMIT = MAX_COST


cdef inline uint64_t _hash(const char *data, size_t length) noexcept nogil:
    return ps_murmur3_x64_128_h1(data, length, 0)


def route_key(data):
    """key(data): the first 64-bit word of MurmurHash3_x64_128(data, seed=0), unsigned."""
    return _key_of(data)


def chain_keys(data, block_bytes, max_blocks):
    """Chained keys of the full blocks of `data` (routing contract 9a), vLLM style:
    c_i = key(le64(c_{i-1}) || block_i), c_{-1} = 0, for the first min(len // B, max_blocks)
    blocks. One pass in C: a 32 KB prompt in 64-byte blocks is ~512 short hashes."""
    cdef Py_buffer view
    cdef size_t block, count, i, j
    cdef uint64_t parent = 0
    cdef char *buffer
    cdef const char *base
    if type(data) is not bytes or type(block_bytes) is not int or type(max_blocks) is not int:
        check_chain_args(data, block_bytes, max_blocks)
    if not 1 <= block_bytes <= MAX_BLOCK_BYTES or max_blocks < 0:
        check_chain_args(data, block_bytes, max_blocks)
    if isinstance(data, memoryview) and not data.c_contiguous:
        data = bytes(data)
    block = <size_t>block_bytes
    cdef uint64_t *out = NULL
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        count = <size_t>view.len // block
        if <object>count > max_blocks:
            count = <size_t>max_blocks
        if count == 0:
            return []
        buffer = <char *>malloc(8 + block)
        out = <uint64_t *>malloc(count * sizeof(uint64_t))
        if buffer == NULL or out == NULL:
            free(buffer)
            free(out)
            raise MemoryError()
        base = <const char *>view.buf
        with nogil:
            for i in range(count):
                for j in range(8):  # le64(parent), whatever the machine's byte order
                    buffer[j] = <char>((parent >> (8 * j)) & 0xFF)
                memcpy(buffer + 8, base + i * block, block)
                parent = _hash(buffer, 8 + block)
                out[i] = parent
        free(buffer)
        try:
            return [out[i] for i in range(count)]
        finally:
            free(out)
    finally:
        PyBuffer_Release(&view)


def prefix_id(text):
    """A prefix's id: the lowercase hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(_utf8(text, "prefix_id")).hexdigest()


def prefix_route_key(text):
    """A prefix's route key: key() of its UTF-8 bytes."""
    return route_key(_utf8(text, "prefix_route_key"))


ctypedef struct Entry:
    uint64_t point
    uint32_t rank    # the member's position in sorted(members): the (point, member) tie-break
    uint32_t member  # the member's position in ring.members


cdef int _compare_entries(const void *a, const void *b) noexcept nogil:
    cdef const Entry *x = <const Entry *>a
    cdef const Entry *y = <const Entry *>b
    if x.point < y.point:
        return -1
    if x.point > y.point:
        return 1
    if x.rank < y.rank:
        return -1
    if x.rank > y.rank:
        return 1
    return 0


cdef inline uint64_t _as_key(object key) except? 0:
    """Fast path for a plain int; everything else goes through the twin's checks."""
    if type(key) is int and key >= 0:
        try:
            return <uint64_t>key
        except OverflowError:
            pass
    return <uint64_t>check_key(key)


cdef class _Table:
    """What Ring and Maglev share: a cycle of member indexes (`_owners`, `_size` long), where
    a key enters it (`_start`, each subclass's own) and everything answered by walking it."""

    cdef readonly tuple members
    cdef readonly tuple weights
    cdef readonly int64_t total_weight
    cdef uint32_t *_owners
    cdef size_t _size
    cdef uint32_t _count
    cdef int64_t *_weights_c
    # "Seen" marks for walks: a member is seen in this walk iff _stamps[m] == _epoch, so a walk
    # starts in O(1) instead of clearing N flags (the request path holds the GIL throughout).
    cdef uint32_t *_stamps
    cdef uint32_t _epoch

    def __cinit__(self, *args, **kwargs):
        self._owners = NULL
        self._weights_c = NULL
        self._stamps = NULL
        self._epoch = 0

    def __dealloc__(self):
        free(self._owners)
        free(self._weights_c)
        free(self._stamps)

    cdef void _set_members(self, tuple members, tuple weights) except *:
        cdef uint32_t i
        self.members = members
        self.weights = weights
        self.total_weight = sum(weights)
        self._count = <uint32_t>len(members)
        self._weights_c = <int64_t *>malloc(self._count * sizeof(int64_t))
        self._stamps = <uint32_t *>calloc(self._count, sizeof(uint32_t))
        if self._weights_c == NULL or self._stamps == NULL:
            raise MemoryError()
        for i in range(self._count):
            self._weights_c[i] = weights[i]

    def __len__(self):
        return self._count

    cdef size_t _start(self, uint64_t key) noexcept nogil:
        return 0

    cdef inline uint32_t _new_walk(self) noexcept:
        """A fresh epoch: no member is seen yet."""
        self._epoch += 1
        if self._epoch == 0:  # wrapped after 2**32 walks: clear the marks once
            memset(self._stamps, 0, self._count * sizeof(uint32_t))
            self._epoch = 1
        return self._epoch

    cdef uint32_t _walk(self, size_t start, uint32_t n, uint32_t *out) noexcept:
        """Write the first n distinct members from position `start` into out."""
        cdef uint32_t found = 0, member
        cdef uint32_t epoch = self._new_walk()
        cdef size_t position = start
        if n > self._count:
            n = self._count
        while found < n:
            member = self._owners[position]
            if self._stamps[member] != epoch:
                self._stamps[member] = epoch
                out[found] = member
                found += 1
            position += 1
            if position == self._size:
                position = 0
        return found

    def owner(self, key):
        """The member the key lands on."""
        return self.members[self._owners[self._start(_as_key(key))]]

    def preference(self, key, n):
        """The first n distinct members walking on from owner(key), owner first."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n is {n}; ask for at least 1 member")
        cdef uint64_t k = _as_key(key)
        cdef uint32_t want = self._count if n > self._count else <uint32_t>n
        cdef uint32_t *out = <uint32_t *>malloc(want * sizeof(uint32_t))
        cdef uint32_t found, i
        if out == NULL:
            raise MemoryError()
        try:
            found = self._walk(self._start(k), want, out)
            return [self.members[out[i]] for i in range(found)]
        finally:
            free(out)

    cdef inline bint _fits(self, double factor, int64_t total, uint32_t member,
                           int64_t load, int64_t min_cap, int64_t cost) noexcept nogil:
        """load + cost <= max(min_cap, cap(member)), exactly, without overflowing int64
        (the caller checked total + cost <= 2**63 - 1, and every load is <= total)."""
        # The floor, as ints: load + cost <= min_cap. Never true for the default min_cap = 0.
        if load <= min_cap - cost:
            return True
        # The contract's order of IEEE-754 double operations: ceil(c * (L + u) * w / W).
        cdef double limit = ceil(
            factor * <double>(total + cost) * <double>self._weights_c[member]
            / <double>self.total_weight
        )
        # A cap >= 2**63 (or +inf, from a huge factor) admits every int64 load; casting it to
        # int64 would be undefined behaviour (x86 yields INT64_MIN, which admits nothing).
        if limit >= 9223372036854775808.0:
            return True
        return load <= <int64_t>limit - cost

    cdef tuple _pick_from(self, object source, bint from_bytes, object loads, object replicas,
                          object factor, object min_cap, object total, object cost,
                          uint64_t *key_out):
        """pick and pick_bytes: the parameters checked first (a fast path for the plain
        types), then the key (of `source`, or hashed from its bytes), then the pick."""
        cdef uint32_t want
        cdef double c = 0.0
        cdef int64_t cap_floor = 0
        if type(replicas) is int and type(factor) is float and type(min_cap) is int:
            c = factor
        if not (c >= 1.0 and c <= DBL_MAX and replicas >= 1 and min_cap >= 0):
            replicas, factor, min_cap = check_pick_args(replicas, factor, min_cap)
            c = factor
        cdef int64_t weight = _checked_cost(cost)
        cap_floor = _clamped_floor(min_cap)
        want = self._count if replicas > self._count else <uint32_t>replicas
        key_out[0] = _key_of(source) if from_bytes else _as_key(source)
        return self._pick_loads(
            self._start(key_out[0]), loads, total, want, NULL, c, cap_floor, weight
        )

    def pick(self, key, loads, replicas=1, factor=1.25, min_cap=0, total=None, cost=1):
        """Bounded-load pick over the replica set; returns (member, branch).

        `min_cap` floors every member's cap: below that many requests in flight a member
        always fits, so a hot prefix stays on its warm home pod at low traffic. `total`, when
        given, must be sum(loads) (the caller's invariant, contract section 4): the pick then
        reads only the loads it needs instead of summing them all. `cost` is what the request
        adds to a load (1 in requests; its tokens when load is counted in tokens).
        """
        cdef uint64_t k
        return self._pick_from(key, False, loads, replicas, factor, min_cap, total, cost, &k)

    def pick_bytes(self, data, loads, replicas=1, factor=1.25, min_cap=0, total=None, cost=1):
        """pick(route_key(data), ...) in one call; returns (member, branch, key)."""
        cdef uint64_t k
        member, branch = self._pick_from(
            data, True, loads, replicas, factor, min_cap, total, cost, &k
        )
        return member, branch, k

    def pick_among(self, key, loads, homes, factor=1.25, min_cap=0, total=None, cost=1):
        """pick with an explicit home set instead of the first R owners (contract 4b).

        `homes` are member indexes into `members` (a budgeted placement's home set, say),
        the earlier one winning ties; the spill walk is pick's, from `key`.
        """
        cdef double c = 0.0
        cdef int64_t cap_floor
        cdef uint32_t count = self._count, want = 0, i
        cdef uint32_t given[64]
        cdef uint32_t *home = given
        cdef uint64_t k
        if type(factor) is float and type(min_cap) is int:
            c = factor
        if not (c >= 1.0 and c <= DBL_MAX and min_cap >= 0):
            _, factor, min_cap = check_pick_args(1, factor, min_cap)
            c = factor
        cdef int64_t weight = _checked_cost(cost)
        cap_floor = _clamped_floor(min_cap)
        if type(homes) is not tuple and type(homes) is not list:
            homes = check_homes(homes, count)
        if len(homes) == 0 or len(homes) > count:
            homes = check_homes(homes, count)  # raises: empty, or a repeated member
        if len(homes) > 64:
            home = <uint32_t *>malloc(len(homes) * sizeof(uint32_t))
            if home == NULL:
                raise MemoryError()
        try:
            for index in homes:
                if type(index) is not int or not 0 <= index < count:
                    check_homes(homes, count)  # raises the contract's error for it
                for i in range(want):
                    if home[i] == <uint32_t>index:
                        check_homes(homes, count)
                home[want] = <uint32_t>index
                want += 1
            k = _as_key(key)
            return self._pick_loads(
                self._start(k), loads, total, want, home, c, cap_floor, weight
            )
        finally:
            if home != given:
                free(home)

    cdef tuple _pick_loads(self, size_t start, object loads, object total, uint32_t want,
                           const uint32_t *given, double factor, int64_t min_cap,
                           int64_t cost):
        """Borrow the loads, take or compute their total, then _pick."""
        cdef Py_buffer view
        cdef int64_t sum_ = 0
        cdef bint checked = total is not None
        _borrow_loads(loads, &view)
        try:
            if checked:
                if type(total) is int and 0 <= total <= MAX_TOTAL_LOAD:
                    sum_ = total
                else:
                    sum_ = check_total(total)
            if view.len // 8 != self._count:
                raise ValueError(
                    f"loads has {view.len // 8} entries for {self._count} members; "
                    "give one load per member, aligned with ring.members"
                )
            if not checked:
                sum_ = _sum_loads(<const int64_t *>view.buf, self._count)
            if sum_ > INT64_MAX - cost:
                check_cost_room(sum_, cost)  # raises the contract's error
            return self._pick(start, <const int64_t *>view.buf, want, given, factor, min_cap,
                              sum_, checked, cost)
        finally:
            PyBuffer_Release(&view)

    cdef inline int64_t _load(self, const int64_t *loads, uint32_t member, int64_t total,
                              bint checked) except? -1:
        """A load as read; with a given total, checked against it (the caller's invariant)."""
        cdef int64_t load = loads[member]
        if checked and (load < 0 or load > total):
            _check_given_load(load, member, total)
        return load

    cdef tuple _pick(self, size_t start, const int64_t *loads, uint32_t want,
                     const uint32_t *given, double factor, int64_t min_cap, int64_t total,
                     bint checked, int64_t cost):
        """The home set is `given` (want members), or the first `want` members from start.
        O(want) when the home fits; the spill walk stops at the first member that fits."""
        cdef uint32_t count = self._count, i, chosen, member, least, found, epoch
        cdef int64_t load, least_load
        cdef uint32_t home[64]
        cdef const uint32_t *members = given
        cdef uint32_t *walk = home
        cdef size_t position
        if given == NULL:
            if want > 64:
                walk = <uint32_t *>malloc(want * sizeof(uint32_t))
                if walk == NULL:
                    raise MemoryError()
            want = self._walk(start, want, walk)
            members = walk
        try:
            chosen = members[0]
            least_load = self._load(loads, chosen, total, checked)
            for i in range(1, want):
                load = self._load(loads, members[i], total, checked)
                if load < least_load:
                    chosen = members[i]
                    least_load = load
        finally:
            if walk != home:
                free(walk)
        if self._fits(factor, total, chosen, least_load, min_cap, cost):
            return self.members[chosen], BRANCH_HOME
        # Spill: walk the preference order (skipping the chosen member), tracking the
        # least-loaded member in that order for the fallback in the same pass.
        epoch = self._new_walk()
        found = 0
        position = start
        least = count
        while found < count:
            member = self._owners[position]
            if self._stamps[member] != epoch:
                self._stamps[member] = epoch
                found += 1
                load = self._load(loads, member, total, checked)
                if least == count or load < least_load:
                    least = member
                    least_load = load
                if member != chosen and self._fits(factor, total, member, load, min_cap, cost):
                    return self.members[member], BRANCH_SPILL
            position += 1
            if position == self._size:
                position = 0
        return self.members[least], BRANCH_FALLBACK

    def session_home(self, family, homes, session):
        """The index of the first member of preference(session, N) that is one of
        preference(family, homes) (routing contract 9b): consistent hashing of the session
        key restricted to the family's home set, so growing the set moves few sessions.
        Written on the preference walk, so a Maglev table answers it the same way."""
        if isinstance(homes, bool) or not isinstance(homes, int):
            raise TypeError(f"homes must be an int, got {type(homes).__name__}")
        if homes < 1:
            raise ValueError(f"homes is {homes}; a home set has at least 1 member")
        cdef uint64_t f = _as_key(family)
        cdef uint64_t k = _as_key(session)
        cdef uint32_t want = self._count if homes > self._count else <uint32_t>homes
        cdef uint32_t given[64]
        cdef uint32_t *home = given
        cdef uint32_t epoch
        cdef size_t position
        if want == self._count:
            return self._owners[self._start(k)]  # every member is home: the session's owner
        if want > 64:
            home = <uint32_t *>malloc(want * sizeof(uint32_t))
            if home == NULL:
                raise MemoryError()
        try:
            # _walk stamps exactly the home set with its fresh epoch; nothing walks between
            # it and the session's walk, so a stamp equal to that epoch marks a home member.
            self._walk(self._start(f), want, home)
            epoch = self._epoch
            position = self._start(k)
            while self._stamps[self._owners[position]] != epoch:
                position += 1
                if position == self._size:
                    position = 0
            return self._owners[position]
        finally:
            if home != given:
                free(home)


cdef class Ring(_Table):
    """An immutable consistent-hash ring; build a new one when membership changes."""

    cdef readonly int vnodes
    cdef uint64_t *_points
    cdef uint32_t *_index
    cdef int _shift

    def __cinit__(self, *args, **kwargs):
        self._points = NULL
        self._index = NULL

    def __init__(self, members, weights=None, vnodes=DEFAULT_VNODES):
        cdef tuple member_tuple
        cdef tuple weight_tuple
        member_tuple, weight_tuple = _check_members(members, weights, vnodes)
        self._set_members(member_tuple, weight_tuple)
        self.vnodes = vnodes
        self._build()

    cdef void _build(self) except *:
        cdef uint32_t count = self._count
        cdef size_t size = <size_t>self.vnodes * <size_t>self.total_weight
        cdef Entry *entries = <Entry *>malloc(size * sizeof(Entry))
        cdef char *buffer = NULL
        cdef size_t position = 0, bucket, buckets, name_length
        cdef uint32_t member_index, rank
        cdef int64_t i, npoints
        cdef int written, bits
        cdef bytes name
        if entries == NULL:
            raise MemoryError()
        ranks = {member: r for r, member in enumerate(sorted(self.members))}
        try:
            for member_index in range(count):
                name = self.members[member_index].encode("utf-8")
                name_length = <size_t>len(name)
                buffer = <char *>malloc(name_length + 32)
                if buffer == NULL:
                    raise MemoryError()
                memcpy(buffer, PyBytes_AS_STRING(name), name_length)
                buffer[name_length] = b'#'
                rank = ranks[self.members[member_index]]
                npoints = <int64_t>self.vnodes * self.weights[member_index]
                with nogil:
                    for i in range(npoints):
                        written = snprintf(buffer + name_length + 1, 24, "%lld", <long long>i)
                        entries[position].point = _hash(buffer, name_length + 1 + written)
                        entries[position].rank = rank
                        entries[position].member = member_index
                        position += 1
                free(buffer)
                buffer = NULL
            with nogil:
                qsort(entries, size, sizeof(Entry), _compare_entries)
            self._points = <uint64_t *>ps_alloc_big(size * sizeof(uint64_t))
            self._owners = <uint32_t *>ps_alloc_big(size * sizeof(uint32_t))
            if self._points == NULL or self._owners == NULL:
                raise MemoryError()
            for position in range(size):
                self._points[position] = entries[position].point
                self._owners[position] = entries[position].member
        finally:
            free(entries)
            free(buffer)
        self._size = size
        bits = 1
        while bits < MAX_INDEX_BITS and (<size_t>1 << bits) < size:
            bits += 1
        self._shift = 64 - bits
        buckets = <size_t>1 << bits
        self._index = <uint32_t *>ps_alloc_big((buckets + 1) * sizeof(uint32_t))
        if self._index == NULL:
            raise MemoryError()
        # _index[b] = first point whose top bits are >= b; _index[buckets] = size.
        position = 0
        for bucket in range(buckets + 1):
            while position < size and (self._points[position] >> self._shift) < bucket:
                position += 1
            self._index[bucket] = <uint32_t>position

    def __dealloc__(self):
        free(self._points)
        free(self._index)

    def __repr__(self):
        return f"Ring({self._count} members, {self._size} points)"

    def __reduce__(self):
        return (Ring, (self.members, self.weights, self.vnodes))

    cdef size_t _start(self, uint64_t key) noexcept nogil:
        """Index of the first point >= key, wrapping to 0: a binary search inside one bucket."""
        cdef size_t bucket = <size_t>(key >> self._shift)
        cdef size_t low = self._index[bucket]
        cdef size_t high = self._index[bucket + 1]
        cdef size_t middle
        # On a big ring (5,000 pods: 5M points) the owner is another cache miss; fetch its
        # line while the search reads the points (the bucket spans a few entries).
        __builtin_prefetch(&self._owners[low])
        while low < high:
            middle = (low + high) >> 1
            if self._points[middle] < key:
                low = middle + 1
            else:
                high = middle
        return 0 if low == self._size else low

    def shares(self):
        """The exact fraction of the 2**64 key space each member owns."""
        cdef uint64_t *low = <uint64_t *>calloc(self._count, sizeof(uint64_t))
        cdef uint64_t *high = <uint64_t *>calloc(self._count, sizeof(uint64_t))
        cdef uint64_t arc, previous
        cdef size_t position
        cdef uint32_t member
        if low == NULL or high == NULL:
            free(low)
            free(high)
            raise MemoryError()
        try:
            # Arcs are differences modulo 2**64, which is exact for the wrap-around arc of the
            # first point too, except when it is the whole space (it then wraps to 0).
            previous = self._points[self._size - 1]
            for position in range(self._size):
                member = self._owners[position]
                arc = self._points[position] - previous
                if position == 0 and arc == 0:
                    high[member] += 1  # one point (or all equal): it owns all 2**64 keys
                low[member] += arc
                if low[member] < arc:
                    high[member] += 1
                previous = self._points[position]
            space = 1 << 64
            result = {}
            for member in range(self._count):
                owned = ((<object>high[member]) << 64) + low[member]
                result[self.members[member]] = owned / space
            return result
        finally:
            free(low)
            free(high)

    def points(self):
        """The sorted (point, member) list: for golden vectors and debugging."""
        return [(self._points[i], self.members[self._owners[i]]) for i in range(self._size)]


cdef class Maglev(_Table):
    """A Maglev lookup table (Eisenbud et al., NSDI 2016), weighted as Envoy's: owner(k) is
    entry k mod M, O(1); the preference order walks on through the entries (section 8)."""

    cdef readonly uint32_t table_size

    def __init__(self, members, weights=None, table_size=DEFAULT_TABLE_SIZE):
        cdef tuple member_tuple
        cdef tuple weight_tuple
        # One "point" per unit of weight: the members' checks without the ring's point budget.
        member_tuple, weight_tuple = _check_members(members, weights, 1)
        self.table_size = check_table_size(table_size, len(member_tuple))
        self._set_members(member_tuple, weight_tuple)
        self._build()

    cdef void _build(self) except *:
        cdef uint32_t count = self._count, size = self.table_size, rank, index
        cdef uint32_t *order = <uint32_t *>malloc(count * sizeof(uint32_t))
        cdef uint64_t *offsets = <uint64_t *>malloc(count * sizeof(uint64_t))
        cdef uint64_t *skips = <uint64_t *>malloc(count * sizeof(uint64_t))
        cdef int64_t *weights = <int64_t *>malloc(count * sizeof(int64_t))
        cdef int64_t max_weight = max(self.weights)
        cdef bytes name
        cdef int result
        self._owners = <uint32_t *>malloc(size * sizeof(uint32_t))
        try:
            if (order == NULL or offsets == NULL or skips == NULL or weights == NULL
                    or self._owners == NULL):
                raise MemoryError()
            ranked = sorted(range(count), key=self.members.__getitem__)
            for rank in range(count):
                index = ranked[rank]
                order[rank] = index
                weights[rank] = self.weights[index]
                name = self.members[index].encode("utf-8")
                offsets[rank] = _hash(PyBytes_AS_STRING(name), len(name)) % size
                skips[rank] = ps_murmur3_x64_128_h1(
                    PyBytes_AS_STRING(name), len(name), 1) % (size - 1) + 1
            with nogil:
                result = _maglev_fill(count, order, offsets, skips, weights, max_weight, size,
                                      self._owners)
            if result == -1:
                raise MemoryError()
            if result >= 0:
                raise ValueError(
                    f"member {self.members[result]!r} got no entry of the {size}-entry Maglev "
                    "table: its weight is too small next to the others'; raise table_size or "
                    "its weight"
                )
        finally:
            free(order)
            free(offsets)
            free(skips)
            free(weights)
        self._size = size

    def __repr__(self):
        return f"Maglev({self._count} members, {self.table_size} entries)"

    def __reduce__(self):
        return (Maglev, (self.members, self.weights, self.table_size))

    cdef size_t _start(self, uint64_t key) noexcept nogil:
        return <size_t>(key % self.table_size)

    def shares(self):
        """The exact fraction of the 2**64 key space each member owns: entry e holds the
        keys k with k mod M == e."""
        each, extra = divmod(1 << 64, self.table_size)
        owned = [0] * self._count
        cdef uint32_t entry
        for entry in range(self.table_size):
            owned[self._owners[entry]] += each + (1 if entry < extra else 0)
        space = 1 << 64
        return {member: owned[i] / space for i, member in enumerate(self.members)}

    def table(self):
        """The member of every entry, in entry order: for golden vectors and debugging."""
        return [self.members[self._owners[i]] for i in range(self.table_size)]


cdef inline bint _heap_less(const uint64_t *due, const uint32_t *rank, size_t a,
                            size_t b) noexcept nogil:
    return due[a] < due[b] or (due[a] == due[b] and rank[a] < rank[b])


cdef inline void _heap_swap(uint64_t *due, uint32_t *rank, size_t a, size_t b) noexcept nogil:
    cdef uint64_t d = due[a]
    cdef uint32_t r = rank[a]
    due[a] = due[b]
    rank[a] = rank[b]
    due[b] = d
    rank[b] = r


cdef int64_t _maglev_fill(uint32_t count, const uint32_t *order, const uint64_t *offsets,
                          const uint64_t *skips, const int64_t *weights, int64_t max_weight,
                          uint32_t size, uint32_t *table) noexcept nogil:
    """Routing contract section 8, the twin's maglev_fill: members (by rank, code-point order
    of their ids) take entries in order of (round, rank), the k-th entry of a member of
    weight w due in round ceil(k * max_w / w); a binary heap yields that order. Returns -2 on
    success, -1 when out of memory, or the index of a member that got no entry."""
    cdef uint64_t *tried = <uint64_t *>calloc(count, sizeof(uint64_t))
    cdef uint64_t *owned = <uint64_t *>calloc(count, sizeof(uint64_t))
    cdef uint64_t *due = <uint64_t *>malloc(count * sizeof(uint64_t))
    cdef uint32_t *rank = <uint32_t *>malloc(count * sizeof(uint32_t))
    cdef uint32_t filled, r, i
    cdef uint64_t entry, skip, j
    cdef size_t at, child, parent
    cdef int64_t result = -2
    if tried == NULL or owned == NULL or due == NULL or rank == NULL:
        result = -1
    else:
        for i in range(size):
            table[i] = EMPTY_ENTRY
        # The initial heap: rounds ceil(max_w / w), ranks ascending: already a valid heap
        # only if sorted, so sift each one up.
        for i in range(count):
            due[i] = <uint64_t>((max_weight + weights[i] - 1) // weights[i])
            rank[i] = i
            at = i
            while at > 0:
                parent = (at - 1) >> 1
                if not _heap_less(due, rank, at, parent):
                    break
                _heap_swap(due, rank, at, parent)
                at = parent
        for filled in range(size):
            r = rank[0]
            skip = skips[r]
            j = tried[r]
            entry = (offsets[r] + (j % size) * skip) % size
            while table[entry] != EMPTY_ENTRY:
                j += 1
                entry += skip
                if entry >= size:
                    entry -= size
            table[entry] = order[r]
            tried[r] = j + 1
            owned[r] += 1
            # Its next entry's round replaces the top, which then sinks into place.
            due[0] = <uint64_t>(((owned[r] + 1) * <uint64_t>max_weight + <uint64_t>weights[r] - 1)
                                // <uint64_t>weights[r])
            at = 0
            while True:
                child = 2 * at + 1
                if child >= count:
                    break
                if child + 1 < count and _heap_less(due, rank, child + 1, child):
                    child += 1
                if not _heap_less(due, rank, child, at):
                    break
                _heap_swap(due, rank, at, child)
                at = child
        for r in range(count):
            if owned[r] == 0:
                result = order[r]
                break
    free(tried)
    free(owned)
    free(due)
    free(rank)
    return result


cdef uint64_t _key_of(object data) except? 0:
    """key(data) for route_key and pick_bytes: bytes-like only, the GIL released on big ones."""
    cdef Py_buffer view
    cdef uint64_t result
    cdef size_t length
    if type(data) is bytes:
        length = <size_t>PyBytes_GET_SIZE(data)
        if length < RELEASE_GIL_BYTES:
            return _hash(PyBytes_AS_STRING(data), length)
    elif not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"route_key() needs bytes, got {type(data).__name__}; encode text as UTF-8 first"
        )
    if isinstance(data, memoryview) and not data.c_contiguous:
        data = bytes(data)
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            result = _hash(<const char *>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return result


cdef int64_t _sum_loads(const int64_t *loads, uint32_t count) except -1:
    """sum(loads), checking each load (>= 0) and the total (<= 2**63 - 2): O(N). The sum
    is taken without a branch per load; only when it breaks a rule is it walked again, load
    by load, to raise the error the twin raises (the first broken rule in member order)."""
    cdef int64_t total = 0
    cdef uint32_t i
    if ps_sum_loads(loads, count, &total):
        return total
    for i in range(count):
        if loads[i] < 0:
            raise ValueError(
                f"load {loads[i]} is negative; loads are in-flight request counts"
            )
        if loads[i] > INT64_MAX - 1 - total:
            raise ValueError(f"the loads sum to more than {INT64_MAX - 1} (2**63 - 2)")
        total += loads[i]
    return total


cdef inline int64_t _checked_cost(object cost) except -1:
    """A request's cost, 1..MAX_COST: a plain int is read and bounded in C (the default 1
    costs no Python comparison), anything else goes through the twin's check (which raises
    the contract's error)."""
    cdef int overflow = 0
    cdef long long value
    if cost is 1:  # the default: CPython shares its small ints, so a pointer test suffices
        return 1
    if type(cost) is int:
        value = PyLong_AsLongLongAndOverflow(cost, &overflow)
        if overflow == 0 and 1 <= value <= COST_LIMIT:
            return value
    return check_cost(cost)


cdef int64_t _clamped_floor(object min_cap) except? -1:
    """Every load + cost is <= 2**63 - 1 (checked against the loads' total), so a floor at
    or above INT64_MAX admits all of them: clamping it there is exact."""
    try:
        return min_cap
    except OverflowError:
        return INT64_MAX


cdef int _borrow_loads(object loads, Py_buffer *view) except -1:
    """An int64 view of `loads`: borrowed when it is one, else copied once into one."""
    if _get_loads(loads, view):
        return 0
    # array('q', b) would reinterpret bytes as raw int64s, so refuse them (and str) by name.
    if isinstance(loads, (str, bytes, bytearray)):
        raise TypeError(
            f"loads must be a sequence of ints or an array('q'), not {type(loads).__name__}"
        )
    try:
        converted = array.array("q", loads)
    except OverflowError:
        raise ValueError("a load is out of the signed 64-bit range") from None
    _get_loads(converted, view)
    return 0


cdef bint _get_loads(object loads, Py_buffer *view) except -1:
    """Borrow an int64 buffer (array('q'), numpy int64) without copying; False if not one."""
    try:
        PyObject_GetBuffer(loads, view, PyBUF_SIMPLE | PyBUF_FORMAT)
    except (TypeError, BufferError):
        return False
    format = view.format.decode("ascii") if view.format != NULL else "B"
    if view.itemsize == 8 and format.lstrip("@=<") in ("q", "l"):
        return True
    PyBuffer_Release(view)
    return False


HashTable = _Table  # what a routing table is, to its users: a Ring or a Maglev


def make_table(kind, members, weights, vnodes):
    """The routing table a fleet chose (config `hash_table`): "ring" or "maglev"."""
    if kind == "ring":
        return Ring(members, weights, vnodes)
    if kind == "maglev":
        return Maglev(members, weights)
    raise ValueError(f"unknown hash table {kind!r}; choose one of {', '.join(HASH_TABLES)}")
