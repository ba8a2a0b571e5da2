"""Precise routing in a request's scope (issue 29): vLLM keys a prompt's blocks by its LoRA
adapter and its first block by its cache salt too, so every later block differs. The
sidecar keys them as the pods do (kv_events/block_keys.py): a salted prompt cached on an
emulated pod goes there under its own salt, on the gRPC path and the HTTP front, and under
another salt no pod holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prefix_sidecar.kv_events import block_keys
from prefix_sidecar.kv_events.block_keys import chain, stored_keys
from prefix_sidecar.kv_events.decode import BlockStored
from prefix_sidecar.routing.scope import Scope
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER
from prefix_sidecar.v1 import router_pb2
from tests.kv_events.test_precise import POD, PRECISE, TEXT, front_url, precise_sidecar
from tests.server.conftest import wait_for
from tests.upstream.test_pod_faults import counted

SIZE = 16
TOKENS = list(range(100, 100 + 3 * SIZE))


def keyed(event: BlockStored) -> list[int]:
    """Our keys of the blocks `event` stored, as a sidecar makes them from the pods' events."""
    return [key for _, key in stored_keys(event, lambda parent: None)]


def test_a_salted_first_block_keys_the_chain_as_the_request_does() -> None:
    salted = BlockStored((1, 2, 3), None, tuple(TOKENS), SIZE, extra_keys=(("s1",), None, None))
    assert keyed(salted) == chain(TOKENS, SIZE, None, "s1")
    both = BlockStored(
        (1, 2, 3),
        None,
        tuple(TOKENS),
        SIZE,
        lora_name="ad",
        extra_keys=(("ad", "s1"), ("ad",), ("ad",)),
    )
    assert keyed(both) == chain(TOKENS, SIZE, "ad", "s1")
    unsalted = chain(TOKENS, SIZE)
    assert len({chain(TOKENS, SIZE, None, "s2")[0], unsalted[0], keyed(salted)[0]}) == 3
    assert chain(TOKENS, SIZE, None, "") == unsalted  # an empty salt is none, as in vLLM


def test_what_no_prompts_token_ids_key_is_not_keyed() -> None:
    media = BlockStored((1, 2), None, tuple(TOKENS[:32]), SIZE, extra_keys=(("m1", "m2"), None))
    assert keyed(media) == []
    later = BlockStored((1, 2, 3), None, tuple(TOKENS), SIZE, extra_keys=(None, ("m",), None))
    assert keyed(later) == chain(TOKENS, SIZE)[:1]  # the run ends at the block it cannot key


def test_a_block_size_no_event_fills_makes_no_root() -> None:
    # A publisher's block size may be up to 2**20 tokens: a root that wide is 8 MB, and one
    # per salt it names would pile up. An event with no whole block keys nothing, at once.
    misses = block_keys._root_block.cache_info().misses
    for salt in ("a", "b", "c"):
        huge = BlockStored((1,), None, tuple(TOKENS), 1 << 20, extra_keys=((salt,),))
        assert keyed(huge) == []
    assert block_keys._root_block.cache_info().misses == misses


def organic_pick(sidecar: Sidecar, text: str, salt: str) -> str:
    return sidecar.pools.default.router.for_prompt(text, scope=Scope("", salt)).backend


async def complete(
    path: str, stub: Any, session: aiohttp.ClientSession, front: str, text: str, salt: str
) -> str:
    """`text` with `cache_salt` through the sidecar on `path`; the pod that served it."""
    if path == "grpc-complete":
        request = router_pb2.CompleteRequest(input=text, max_tokens=1, cache_salt=salt)
        chunks = [c async for c in stub.Complete(request, timeout=10)]
        return str(chunks[0].backend)
    body = {"model": POD.model, "prompt": text, "max_tokens": 1, "cache_salt": salt}
    async with session.post(front + "/v1/completions", json=body) as answer:
        assert answer.status == 200, await answer.text()
        return answer.headers[BACKEND_HEADER]


@pytest.mark.parametrize("path", ["grpc-complete", "http-completions"])
async def test_a_salted_prompt_goes_where_it_is_cached_under_its_salt(
    tmp_path: Path, path: str
) -> None:
    async with precise_sidecar(tmp_path, 3, front=True) as (fleet, session, sidecar, stub):
        kv_events = sidecar.pools.default.kv_events
        assert kv_events is not None and kv_events.blocks is not None
        await wait_for(lambda: len(kv_events.subscriber.feeds) == len(fleet.urls), 5)
        text = TEXT.format(n=path)
        cached = next(url for url in fleet.urls if url != organic_pick(sidecar, text, "s1"))
        body = {"model": POD.model, "prompt": text, "max_tokens": 1, "cache_salt": "s1"}
        async with session.post(cached + "/v1/completions", json=body) as answer:
            assert answer.status == 200
        blocks = kv_events.blocks
        await wait_for(lambda: blocks.block_count(cached) > 0, 5, "the pod's salted blocks")

        front = front_url(sidecar)
        assert await complete(path, stub, session, front, text, "s1") == cached
        assert counted(sidecar.metrics, PRECISE, outcome="moved") == 1
        # Under another salt the pod holds none of it: it is a cold prompt there.
        await complete(path, stub, session, front, text, "s2")
        assert counted(sidecar.metrics, PRECISE, outcome="moved") == 1
        cold = counted(sidecar.metrics, PRECISE, outcome="cold")
        assert cold + counted(sidecar.metrics, PRECISE, outcome="placed") == 1
