"""tokenizer_file on real vLLM: the model folder's tokenizer.json gives the pod's own
/tokenize ids for prompts (short, long enough to be encoded in a thread, non-ASCII, with a
special token's text), and precise routing trusts it after CHECKS prompts, then asks no pod."""

from __future__ import annotations

from typing import Any, cast

from prefix_sidecar.kv_events.fleet_blocks import FleetBlocks
from prefix_sidecar.kv_events.precise import PreciseRouting
from prefix_sidecar.routing.decision import Decision
from prefix_sidecar.routing.pick import Branch
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.local_tokenizer import CHECKS, INLINE_BYTES, LocalTokenizer
from prefix_sidecar.upstream.tokenize import token_ids
from prefix_sidecar_tools.vllm.fleet import VllmFleet
from prefix_sidecar_tools.vllm.tiny_model import document
from tests.vllm.conftest import VLLM_TESTS

pytestmark = VLLM_TESTS

PROMPTS = [
    "Refunds within 7 days.",
    document("local-tokenizer", 400),
    document("local-tokenizer-long", 4 * INLINE_BYTES // 5),  # over INLINE_BYTES: a thread
    "Rückerstattung binnen 7 Tagen; 退款七天内。 <s> then </s>",
]


async def test_the_model_files_tokenizer_gives_the_pods_ids_and_is_trusted(
    fleet: VllmFleet,
) -> None:
    local = LocalTokenizer.load(str(fleet.model_dir / "tokenizer.json"))
    url = fleet.urls[0]
    async with UpstreamClient() as client:
        for prompt in PROMPTS:
            pod = await token_ids(client, url, prompt, model=fleet.model)
            assert await local.ids(prompt) == pod, prompt[:40]
        assert len(PROMPTS[2].encode()) > INLINE_BYTES

        routing = PreciseRouting(client, FleetBlocks(), cast(Any, None), local=local)
        decision = Decision(url, [url], None, 0, Branch.HOME, 0, 0)
        asked = 0
        tokens_of = routing.asked

        async def counted(*args: Any) -> list[int]:
            nonlocal asked
            asked += 1
            return await tokens_of(*args)

        routing.asked = counted  # type: ignore[method-assign,assignment]
        for n in range(CHECKS + 2):
            prompt = f"{n}. " + PROMPTS[1]
            expected = await token_ids(client, url, prompt, model=fleet.model)
            assert await routing.tokens(decision, {"prompt": prompt}, fleet.model) == expected
        assert local.trusted and asked == CHECKS
