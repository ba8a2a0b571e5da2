"""`kv_events=true` in a running Sidecar: it follows its members' KV events into its
residency and counts them per pod; off (the default), it opens no socket for them."""

from __future__ import annotations

import contextlib
from pathlib import Path

from prefix_sidecar.v1 import router_pb2
from tests.kv_events.publisher import Publisher, byte_tokens, payload
from tests.server.conftest import running_sidecar, sidecar_config, wait_for

BLOCK = 4


async def test_a_sidecar_with_kv_events_knows_where_a_prefix_lives(tmp_path: Path) -> None:
    """A registered prefix's token ids from the pod's /tokenize, its blocks from the pod's
    events: resident there; the events counted per pod."""
    async with Publisher(replay=False) as publisher:
        config = sidecar_config(tmp_path, [publisher.url], kv_events=True)
        async with running_sidecar(config) as (sidecar, stub):
            text = "a registered prefix"  # 19 byte tokens: 4 whole blocks
            request = router_pb2.RegisterPrefixRequest(name="p", text=text)
            registered = await stub.RegisterPrefix(request, timeout=10)
            await publisher.subscribed()
            tokens = byte_tokens(text)
            whole = len(tokens) // BLOCK * BLOCK
            event = {
                "type": "BlockStored",
                "block_hashes": [2**64 - 1 - i for i in range(whole // BLOCK)],
                "parent_block_hash": None,
                "token_ids": tokens[:whole],
                "block_size": BLOCK,
            }
            await publisher.send(0, payload(event))
            await wait_for(
                lambda: sidecar.pools.default.residency.resident(registered.id) == [publisher.url]
            )
            await publisher.send(1, payload({"type": "BlockRemoved", "block_hashes": [2**64 - 2]}))
            await wait_for(lambda: sidecar.pools.default.residency.resident(registered.id) == [])
            page = sidecar.metrics.render().decode()
    counted = f'prefix_sidecar_kv_events_total{{backend="{publisher.url}",outcome="batch"}} 2.0'
    assert counted in page
    assert f'prefix_sidecar_kv_event_lag_seconds{{backend="{publisher.url}"}}' in page


async def test_off_by_default(tmp_path: Path) -> None:
    config = sidecar_config(tmp_path, ["http://127.0.0.1:9"])
    async with running_sidecar(config, wait=False) as (sidecar, _):
        assert sidecar.pools.default.kv_events is None


async def test_only_the_home_sets_of_registered_prefixes_are_followed(tmp_path: Path) -> None:
    """Four pods, prefixes of one replica: the sidecar subscribes to each prefix's home and
    to no other pod, follows a new prefix's home, and leaves an unregistered one's."""
    async with contextlib.AsyncExitStack() as stack:
        pods = [await stack.enter_async_context(Publisher()) for _ in range(4)]
        urls = [pod.url for pod in pods]
        config = sidecar_config(tmp_path, urls, kv_events=True)
        sidecar, stub = await stack.enter_async_context(running_sidecar(config))
        assert sidecar.pools.default.kv_events is not None
        feeds = sidecar.pools.default.kv_events.subscriber.feeds
        assert not feeds  # nothing registered: no pod to follow

        def homes() -> set[str]:
            return {
                url
                for entry in sidecar.pools.default.store
                for url in sidecar.pools.default.router.home_set(entry)
            }

        ids = []
        for name in ("a", "b", "c"):
            request = router_pb2.RegisterPrefixRequest(name=name, text=f"prefix {name}", replicas=1)
            ids.append((await stub.RegisterPrefix(request, timeout=10)).id)
            await wait_for(lambda: feeds.keys() == homes())
        assert 1 <= len(feeds) <= 3 < len(urls)
        for pod in pods:
            if pod.url in feeds:
                await pod.subscribed()  # a real SUB socket on each home
        for prefix_id in ids:
            await stub.UnregisterPrefix(
                router_pb2.UnregisterPrefixRequest(prefix_id=prefix_id), timeout=10
            )
        await wait_for(lambda: not feeds)
