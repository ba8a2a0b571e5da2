"""`kv_events=true` in a running Sidecar: it follows its members' KV events into its
residency and counts them per pod; off (the default), it opens no socket for them."""

from __future__ import annotations

from pathlib import Path

from tests.kv_events.publisher import Publisher, payload
from tests.server.conftest import running_sidecar, sidecar_config, wait_for

BLOCK = 4
PREFIX = list(range(100, 112))


async def test_a_sidecar_with_kv_events_knows_where_a_prefix_lives(tmp_path: Path) -> None:
    async with Publisher(replay=False) as publisher:
        config = sidecar_config(tmp_path, [publisher.url], kv_events=True)
        async with running_sidecar(config, wait=False) as (sidecar, _):
            sidecar.residency.watch_prefix("p", PREFIX)
            await publisher.subscribed()
            body = payload(
                {
                    "type": "BlockStored",
                    "block_hashes": [2**64 - 1, 5, 6],
                    "parent_block_hash": None,
                    "token_ids": PREFIX,
                    "block_size": BLOCK,
                }
            )
            await publisher.send(0, body)
            await wait_for(lambda: sidecar.residency.resident("p") == [publisher.url])
            page = sidecar.metrics.render().decode()
    counted = f'prefix_sidecar_kv_events_total{{backend="{publisher.url}",outcome="batch"}} 1.0'
    assert counted in page
    assert f'prefix_sidecar_kv_event_lag_seconds{{backend="{publisher.url}"}}' in page


async def test_off_by_default(tmp_path: Path) -> None:
    config = sidecar_config(tmp_path, ["http://127.0.0.1:9"])
    async with running_sidecar(config, wait=False) as (sidecar, _):
        assert sidecar.kv_events is None
