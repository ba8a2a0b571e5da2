"""A warm prefix whose homes move is prewarmed on its new homes (NewHomeWarmup), checked by
what the pods themselves report: the moved prefix's first query there is a cache hit.

The homes move when the pods report their KV size after the prefixes were prewarmed: the
placement then spreads the prefix tokens under the budget, away from the plain ring's
homes (on a 2-pod vLLM fleet, 3 of 8 prefixes moved, `bench real --engine vllm`)."""

from __future__ import annotations

from pathlib import Path

from prefix_sidecar.membership.pool import SERVING
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar_tools.emulator import EmulatorConfig, run_emulator

from .conftest import cached_tokens, sidecar_config, wait_for

FAST = EmulatorConfig(time_scale=1000.0, kv_tokens=200_000)


def prefix_text(i: int) -> str:
    return f"rulebook {i}: " + f"clause {i} of the mega-sale rules. " * 300


async def test_prefixes_warm_on_the_homes_the_placement_moves_them_to(tmp_path: Path) -> None:
    async with run_emulator(FAST) as a, run_emulator(FAST) as b:
        # The pods' KV is reported by hand below, when the test says: no polls.
        config = sidecar_config(tmp_path, [a, b], load_signals=False)
        async with Sidecar(config) as sidecar:
            await wait_for(
                lambda: all(
                    b.state == SERVING for b in sidecar.pools.default.pool.backends.values()
                ),
                what="both pods serving",
            )
            # Five prefixes on pod a's ring arc and three on b's: a budget of 4.5 prefixes a
            # pod must move one (the ring's arcs depend on the pods' random ports).
            wanted = {a: 5, b: 3}
            entries, texts = [], {}
            for i in range(200):
                entry = sidecar.pools.default.store.register(f"p{i}", prefix_text(i))[0]
                (home,) = sidecar.pools.default.router.home_set(entry)
                if wanted[home] == 0:
                    sidecar.pools.default.store.unregister_id(entry.id)
                    continue
                wanted[home] -= 1
                entries.append(entry)
                texts[entry.id] = prefix_text(i)
                if not any(wanted.values()):
                    break
            first = {e.id: sidecar.pools.default.router.home_set(e) for e in entries}
            pairs = [(e, url) for e in entries for url in first[e.id]]
            for event in await sidecar.pools.default.prewarmer.warm_all(pairs):
                sidecar.pools.default.pool.note_warm_prefix(event.backend, event.prefix_id)
            total = sum(sidecar.pools.default.router.placer.tokens_of(e) for e in entries)
            # Pods of KV 2x the prefixes' half: a budget of about half the prefix tokens each.
            sidecar.pools.default._pods_kv_changed(total + total // 8)
            moved = [e for e in entries if sidecar.pools.default.router.home_set(e) != first[e.id]]
            assert moved, "the budget moved no prefix: the test shows nothing"

            def all_homes_warm() -> bool:
                return all(
                    e.id in sidecar.pools.default.pool.backends[url].warm_prefixes
                    for e in entries
                    for url in sidecar.pools.default.router.home_set(e)
                )

            await wait_for(all_homes_warm, timeout=10.0, what="every home warm")
            for entry in moved:
                (home,) = sidecar.pools.default.router.home_set(entry)
                assert await cached_tokens(home, texts[entry.id]) > 0, (entry.id, home)
