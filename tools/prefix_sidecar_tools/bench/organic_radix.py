"""The radix-tree baseline of `bench organic`: a central router like SGLang's `cache_aware`.

Our own implementation of the policy of sgl-router (src/policies/cache_aware.rs and tree.rs):
- an approximate radix tree over the request TEXT (characters, no tokenizer), shared by all
  workers: every node records which workers (tenants) were sent text through it, and when;
- a request goes to the worker whose text matches its longest prefix when the match covers
  more than `cache_threshold` of the text; otherwise to the worker with the least text in
  the tree (the most free cache, as far as the router knows); either way its text is then
  inserted for that worker;
- unless the load is imbalanced, (max - min) in-flight > `balance_abs` AND max > min x
  `balance_rel`: then the least loaded worker takes it (its text still inserted);
- every `eviction_interval_s` each worker's text is cut to `max_tree_chars` by evicting its
  least recently used leaves.
Defaults are sgl-router's (0.3, 64, 1.5); the tree size and interval are the bench's (see
organic.py): SGLang's 2**26 characters would never evict in a run this short.

It is one router with one tree: a central router, as the issue asks, not K independent ones.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

CHUNK = 64  # characters compared per slice when measuring a shared prefix


def shared_length(text: str, start: int, other: str) -> int:
    """How many characters of `other` equal text[start:...], from the first on."""
    limit = min(len(other), len(text) - start)
    done = 0
    while done < limit:  # whole chunks by slice compare (C speed), then the last one by char
        step = min(CHUNK, limit - done)
        if text[start + done : start + done + step] == other[done : done + step]:
            done += step
            continue
        while done < limit and text[start + done] == other[done]:
            done += 1
        return done
    return done


class _Node:
    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character -> child
        self.tenants: dict[str, float] = {}  # worker -> last access time


class ApproximateRadixTree:
    """Characters sent to each worker, shared where their texts share a prefix."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = _Node("", None)
        self.tenant_chars: dict[str, int] = {}  # characters the tree holds per worker
        self.clock = clock

    def insert(self, text: str, tenant: str) -> None:
        now = self.clock()
        node = self.root
        node.tenants[tenant] = now
        self.tenant_chars.setdefault(tenant, 0)
        at = 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                leaf = _Node(text[at:], node)
                leaf.tenants[tenant] = now
                node.children[text[at]] = leaf
                self.tenant_chars[tenant] += len(leaf.text)
                return
            shared = shared_length(text, at, child.text)
            if shared < len(child.text):
                child = self._split(child, shared)
            if tenant not in child.tenants:
                self.tenant_chars[tenant] += len(child.text)
            child.tenants[tenant] = now
            node = child
            at += shared

    @staticmethod
    def _split(node: _Node, at: int) -> _Node:
        """Cut `node` after `at` characters; returns the new upper half (same tenants)."""
        assert node.parent is not None and 0 < at < len(node.text)
        upper = _Node(node.text[:at], node.parent)
        upper.tenants = dict(node.tenants)
        node.parent.children[node.text[0]] = upper
        node.text = node.text[at:]
        node.parent = upper
        upper.children[node.text[0]] = node
        return upper

    def prefix_match(self, text: str) -> tuple[int, str | None]:
        """(characters matched, the worker that most recently took the deepest match)."""
        node = self.root
        at = 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                break
            shared = shared_length(text, at, child.text)
            at += shared
            node = child
            if shared < len(child.text):
                break
        if node is self.root or not node.tenants:
            return 0, None
        tenant = max(node.tenants.items(), key=lambda item: item[1])[0]
        return at, tenant

    def smallest_tenant(self, tenants: Sequence[str]) -> str:
        """The worker with the least text in the tree (first in `tenants` on a tie)."""
        return min(tenants, key=lambda t: self.tenant_chars.get(t, 0))

    def evict_tenant_by_size(self, max_chars: int) -> int:
        """Evict each worker's least recently used leaves until it holds <= max_chars;
        returns the characters evicted."""
        evicted = 0
        for tenant, chars in list(self.tenant_chars.items()):
            if chars <= max_chars:
                continue
            heap = [(n.tenants[tenant], id(n), n) for n in self._leaves_of(tenant)]
            heapq.heapify(heap)
            while self.tenant_chars[tenant] > max_chars and heap:
                _, _, node = heapq.heappop(heap)
                del node.tenants[tenant]
                self.tenant_chars[tenant] -= len(node.text)
                evicted += len(node.text)
                parent = node.parent
                if not node.tenants and not node.children and parent is not None:
                    del parent.children[node.text[0]]
                if (
                    parent is not None
                    and parent is not self.root
                    and tenant in parent.tenants
                    and not any(tenant in c.tenants for c in parent.children.values())
                ):
                    heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        return evicted

    def _leaves_of(self, tenant: str) -> list[_Node]:
        leaves: list[_Node] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if tenant not in node.tenants:
                continue
            below = [c for c in node.children.values() if tenant in c.tenants]
            if below:
                stack.extend(below)
            else:
                leaves.append(node)
        return leaves


class CacheAwareRouter:
    """SGLang-style cache-aware routing over `workers`; the caller reports in-flight counts
    through `started`/`finished`."""

    def __init__(
        self,
        workers: Sequence[str],
        *,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        max_tree_chars: int = 2**26,
        eviction_interval_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not workers:
            raise ValueError("the router needs at least one worker")
        self.workers = list(workers)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_chars = max_tree_chars
        self.eviction_interval_s = eviction_interval_s
        self.clock = clock
        self.tree = ApproximateRadixTree(clock)
        for worker in self.workers:
            self.tree.insert("", worker)
        self.loads = dict.fromkeys(self.workers, 0)
        self.balanced_picks = self.cache_picks = self.smallest_picks = 0
        self.evicted_chars = 0
        self._last_eviction = clock()

    def evict_if_due(self) -> None:
        """The periodic eviction; sgl-router runs it on a background thread, off the
        request path, so the caller runs it outside the decision it times."""
        now = self.clock()
        if now - self._last_eviction >= self.eviction_interval_s:
            self._last_eviction = now
            self.evicted_chars += self.tree.evict_tenant_by_size(self.max_tree_chars)

    def select(self, text: str) -> str:
        highest, lowest = max(self.loads.values()), min(self.loads.values())
        if highest - lowest > self.balance_abs and highest > lowest * self.balance_rel:
            chosen = min(self.workers, key=lambda w: self.loads[w])
            self.balanced_picks += 1
        else:
            matched, tenant = self.tree.prefix_match(text)
            rate = matched / len(text) if text else 0.0
            if tenant is not None and rate > self.cache_threshold:
                chosen = tenant
                self.cache_picks += 1
            else:
                chosen = self.tree.smallest_tenant(self.workers)
                self.smallest_picks += 1
        self.tree.insert(text, chosen)
        return chosen

    def started(self, worker: str) -> None:
        self.loads[worker] += 1

    def finished(self, worker: str) -> None:
        self.loads[worker] -= 1
