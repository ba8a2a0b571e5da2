# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Routing contract v1, compiled: the fast twin of sidecar/_core_py.py.

Same API and results to the bit (docs/routing-contract.md, tests/core/). The ring is built once
per membership change, Envoy ring_hash style: points are hashed and sorted in C, then a bucket
index on the top bits of the key makes owner() a short search inside one bucket instead of a
binary search over the whole ring. Validation of construction arguments is shared with the
twin (it is not hot); everything on the per-request path is checked here, in C.
"""

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.float cimport DBL_MAX
from libc.math cimport ceil
from libc.stdint cimport INT64_MAX, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport calloc, free, malloc, qsort
from libc.string cimport memcpy

import array
import hashlib

from sidecar._core_py import (
    BRANCH_FALLBACK,
    BRANCH_HOME,
    BRANCH_SPILL,
    DEFAULT_VNODES,
    MAX_BLOCK_BYTES,
    _check_members,
    _utf8,
    check_chain_args,
    check_homes,
    check_key,
    check_pick_args,
)

cdef extern from "murmur3.h":
    uint64_t ps_murmur3_x64_128_h1(const void *key, size_t length, uint32_t seed) nogil

# Hashing a whole fat prompt (240 KB) takes tens of microseconds: let other threads run.
cdef size_t RELEASE_GIL_BYTES = 65536
# Bucket index size: about one bucket per point, at most 2**20 buckets (4 MiB).
cdef int MAX_INDEX_BITS = 20


cdef inline uint64_t _hash(const char *data, size_t length) noexcept nogil:
    return ps_murmur3_x64_128_h1(data, length, 0)


def route_key(data):
    """key(data): the first 64-bit word of MurmurHash3_x64_128(data, seed=0), unsigned."""
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


def chain_keys(data, block_bytes, max_blocks):
    """Chained keys of the full blocks of `data` (routing contract 8a), vLLM style:
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


cdef class Ring:
    """An immutable consistent-hash ring; build a new one when membership changes."""

    cdef readonly tuple members
    cdef readonly tuple weights
    cdef readonly int vnodes
    cdef readonly int64_t total_weight
    cdef uint64_t *_points
    cdef uint32_t *_owners
    cdef uint32_t *_index
    cdef size_t _size
    cdef int _shift
    cdef uint32_t _count
    cdef int64_t *_weights_c

    def __cinit__(self, *args, **kwargs):
        self._points = NULL
        self._owners = NULL
        self._index = NULL
        self._weights_c = NULL

    def __init__(self, members, weights=None, vnodes=DEFAULT_VNODES):
        cdef tuple member_tuple
        cdef tuple weight_tuple
        member_tuple, weight_tuple = _check_members(members, weights, vnodes)
        self.members = member_tuple
        self.weights = weight_tuple
        self.vnodes = vnodes
        self.total_weight = sum(weight_tuple)
        self._count = <uint32_t>len(member_tuple)
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
        self._weights_c = <int64_t *>malloc(count * sizeof(int64_t))
        if self._weights_c == NULL:
            free(entries)
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
                self._weights_c[member_index] = self.weights[member_index]
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
            self._points = <uint64_t *>malloc(size * sizeof(uint64_t))
            self._owners = <uint32_t *>malloc(size * sizeof(uint32_t))
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
        self._index = <uint32_t *>malloc((buckets + 1) * sizeof(uint32_t))
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
        free(self._owners)
        free(self._index)
        free(self._weights_c)

    def __len__(self):
        return self._count

    def __repr__(self):
        return f"Ring({self._count} members, {self._size} points)"

    def __reduce__(self):
        return (Ring, (self.members, self.weights, self.vnodes))

    cdef inline size_t _start(self, uint64_t key) noexcept nogil:
        """Index of the first point >= key, wrapping to 0: a binary search inside one bucket."""
        cdef size_t bucket = <size_t>(key >> self._shift)
        cdef size_t low = self._index[bucket]
        cdef size_t high = self._index[bucket + 1]
        cdef size_t middle
        while low < high:
            middle = (low + high) >> 1
            if self._points[middle] < key:
                low = middle + 1
            else:
                high = middle
        return 0 if low == self._size else low

    def owner(self, key):
        """The member of the first point >= key, wrapping to the first point."""
        return self.members[self._owners[self._start(_as_key(key))]]

    cdef uint32_t _walk(self, size_t start, uint32_t n, uint32_t *out) except? 0xFFFFFFFF:
        """Write the first n distinct members clockwise from point `start` into out."""
        cdef uint32_t found = 0, member, j
        cdef size_t position = start
        cdef uint8_t *seen = NULL
        cdef bint duplicate
        if n > self._count:
            n = self._count
        if n > 8:
            seen = <uint8_t *>calloc(self._count, 1)
            if seen == NULL:
                raise MemoryError()
        while found < n:
            member = self._owners[position]
            if seen != NULL:
                duplicate = seen[member]
                seen[member] = 1
            else:
                duplicate = False
                for j in range(found):
                    if out[j] == member:
                        duplicate = True
                        break
            if not duplicate:
                out[found] = member
                found += 1
            position += 1
            if position == self._size:
                position = 0
        free(seen)
        return found

    def preference(self, key, n):
        """The first n distinct members walking clockwise from owner(key), owner first."""
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
                           int64_t load, int64_t min_cap) noexcept nogil:
        """load + 1 <= max(min_cap, cap(member)), exactly, without overflowing int64."""
        # The floor, as ints: load + 1 <= min_cap. Never true for the default min_cap = 0.
        if load < min_cap:
            return True
        # The contract's order of IEEE-754 double operations: ceil(c * (L + 1) * w / W).
        cdef double limit = ceil(
            factor * <double>(total + 1) * <double>self._weights_c[member]
            / <double>self.total_weight
        )
        # A cap >= 2**63 (or +inf, from a huge factor) admits every int64 load; casting it to
        # int64 would be undefined behaviour (x86 yields INT64_MIN, which admits nothing).
        if limit >= 9223372036854775808.0:
            return True
        return load < <int64_t>limit

    def pick(self, key, loads, replicas=1, factor=1.25, min_cap=0):
        """Bounded-load pick over the replica set; returns (member, branch).

        `min_cap` floors every member's cap: below that many requests in flight a member
        always fits, so a hot prefix stays on its warm home pod at low traffic.
        """
        cdef uint32_t want
        cdef double c = 0.0
        cdef int64_t cap_floor = 0
        if type(replicas) is int and type(factor) is float and type(min_cap) is int:
            c = factor
        if not (c >= 1.0 and c <= DBL_MAX and replicas >= 1 and min_cap >= 0):
            replicas, factor, min_cap = check_pick_args(replicas, factor, min_cap)
            c = factor
        cap_floor = _clamped_floor(min_cap)
        want = self._count if replicas > self._count else <uint32_t>replicas
        cdef uint64_t k = _as_key(key)
        cdef Py_buffer view
        _borrow_loads(loads, &view)
        try:
            return self._pick(k, <const int64_t *>view.buf, view.len // 8, want, NULL, c,
                              cap_floor)
        finally:
            PyBuffer_Release(&view)

    def pick_among(self, key, loads, homes, factor=1.25, min_cap=0):
        """pick with an explicit home set instead of the first R owners (contract 4b).

        `homes` are member indexes into `members` (a budgeted placement's home set, say),
        the earlier one winning ties; the spill walk is pick's, clockwise from `key`.
        """
        cdef double c = 0.0
        cdef int64_t cap_floor
        cdef uint32_t count = self._count, want = 0, i
        cdef uint32_t given[64]
        cdef uint32_t *home = given
        cdef uint64_t k
        cdef Py_buffer view
        if type(factor) is float and type(min_cap) is int:
            c = factor
        if not (c >= 1.0 and c <= DBL_MAX and min_cap >= 0):
            _, factor, min_cap = check_pick_args(1, factor, min_cap)
            c = factor
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
            _borrow_loads(loads, &view)
            try:
                return self._pick(k, <const int64_t *>view.buf, view.len // 8, want, home, c,
                                  cap_floor)
            finally:
                PyBuffer_Release(&view)
        finally:
            if home != given:
                free(home)

    cdef tuple _pick(self, uint64_t key, const int64_t *loads, Py_ssize_t length,
                     uint32_t want, const uint32_t *given, double factor, int64_t min_cap):
        """The home set is `given` (want members), or the first `want` owners of the key."""
        cdef uint32_t count = self._count, i, chosen, member, least, found
        cdef int64_t total = 0
        cdef uint32_t home[64]
        cdef uint32_t *walk = home
        cdef size_t start, position
        cdef uint8_t *seen
        if length != count:
            raise ValueError(
                f"loads has {length} entries for {count} members; "
                "give one load per member, aligned with ring.members"
            )
        for i in range(count):
            if loads[i] < 0:
                raise ValueError(
                    f"load {loads[i]} is negative; loads are in-flight request counts"
                )
            if loads[i] > INT64_MAX - 1 - total:
                raise ValueError(f"the loads sum to more than {INT64_MAX - 1} (2**63 - 2)")
            total += loads[i]
        start = self._start(key)
        if given != NULL:
            chosen = given[0]
            for i in range(1, want):
                if loads[given[i]] < loads[chosen]:
                    chosen = given[i]
        else:
            if want > 64:
                walk = <uint32_t *>malloc(want * sizeof(uint32_t))
                if walk == NULL:
                    raise MemoryError()
            try:
                found = self._walk(start, want, walk)
                chosen = walk[0]
                for i in range(1, found):
                    if loads[walk[i]] < loads[chosen]:
                        chosen = walk[i]
            finally:
                if walk != home:
                    free(walk)
        if self._fits(factor, total, chosen, loads[chosen], min_cap):
            return self.members[chosen], BRANCH_HOME
        # Spill: walk the whole preference order (skipping the chosen member), tracking the
        # least-loaded member in ring order for the fallback in the same pass.
        seen = <uint8_t *>calloc(count, 1)
        if seen == NULL:
            raise MemoryError()
        try:
            found = 0
            position = start
            least = self._owners[start]
            while found < count:
                member = self._owners[position]
                if not seen[member]:
                    seen[member] = 1
                    found += 1
                    if loads[member] < loads[least]:
                        least = member
                    if member != chosen and self._fits(
                        factor, total, member, loads[member], min_cap
                    ):
                        return self.members[member], BRANCH_SPILL
                position += 1
                if position == self._size:
                    position = 0
        finally:
            free(seen)
        return self.members[least], BRANCH_FALLBACK

    def session_home(self, family, homes, session):
        """The index of the first member of preference(session, N) that is one of
        preference(family, homes) (routing contract 8b): consistent hashing of the session
        key restricted to the family's home set, so growing the set moves few sessions."""
        if isinstance(homes, bool) or not isinstance(homes, int):
            raise TypeError(f"homes must be an int, got {type(homes).__name__}")
        if homes < 1:
            raise ValueError(f"homes is {homes}; a home set has at least 1 member")
        cdef uint64_t f = _as_key(family)
        cdef uint64_t k = _as_key(session)
        cdef uint32_t want = self._count if homes > self._count else <uint32_t>homes
        cdef uint32_t given[64]
        cdef uint32_t *home = given
        cdef uint8_t *marked
        cdef uint32_t found, i
        cdef size_t position
        if want == self._count:
            return self._owners[self._start(k)]  # every member is home: the session's owner
        if want > 64:
            home = <uint32_t *>malloc(want * sizeof(uint32_t))
            if home == NULL:
                raise MemoryError()
        marked = <uint8_t *>calloc(self._count, 1)
        if marked == NULL:
            if home != given:
                free(home)
            raise MemoryError()
        try:
            found = self._walk(self._start(f), want, home)
            for i in range(found):
                marked[home[i]] = 1
            position = self._start(k)
            while not marked[self._owners[position]]:
                position += 1
                if position == self._size:
                    position = 0
            return self._owners[position]
        finally:
            free(marked)
            if home != given:
                free(home)

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


cdef int64_t _clamped_floor(object min_cap) except? -1:
    """Every load + 1 is <= 2**63 - 1 (the loads sum to <= 2**63 - 2), so a floor at or
    above INT64_MAX admits all of them: clamping it there is exact."""
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
