"""The token ids of each registered prefix, from a pod's POST /tokenize, handed to the
residency (its block keys are made from token ids, as the pods' BlockStored events carry).

One background task, woken on a registration or a membership change; a prefix is asked
once (ATTEMPTS_PER_PREFIX tries), its answer bounded and checked by `upstream.tokenize.token_ids`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from prefix_sidecar.prefixes import PrefixEntry, PrefixStore
from prefix_sidecar.upstream.client import UpstreamClient
from prefix_sidecar.upstream.tokenize import PrefixPass, token_ids


class PrefixWatcher(Protocol):
    """The residency (kv_events/residency.py), or the sink in front of it (reprewarm.py)."""

    def watch_prefix(
        self, prefix_id: str, token_ids: Sequence[int], lora_name: str | None = None
    ) -> None: ...

    def forget_prefix(self, prefix_id: str) -> None: ...


class PrefixTokens(PrefixPass):
    what = "token ids for its residency"

    def __init__(
        self,
        store: PrefixStore,
        client: UpstreamClient,
        residency: PrefixWatcher,
        pods: Callable[[], Sequence[str]],
        *,
        model: str = "",
    ) -> None:
        super().__init__(store, client, pods, model=model)
        self.residency = residency  # learnt: how many token ids each watched prefix has

    def forget(self, live: set[str]) -> None:
        for gone in self.learnt.keys() - live:
            self.residency.forget_prefix(gone)
        super().forget(live)

    def done(self, entry: PrefixEntry) -> bool:
        # A salted prefix is not watched: the residency's chains are unsalted, so where it
        # lives stays unknown; it is neither routed around nor prewarmed again on an event.
        return entry.id in self.learnt or bool(entry.scope.salt)

    async def ask(self, pod: str, entry: PrefixEntry) -> None:
        tokens = await token_ids(self.client, pod, entry.text, model=self.model)
        if self.store.has_id(entry.id):
            # An adapter's blocks chain from a root of its name, as the pods' events do.
            self.residency.watch_prefix(entry.id, tokens, entry.scope.adapter or None)
            self.learnt[entry.id] = len(tokens)
            if tokens:  # the same count the sizer asks for: known as soon as the residency
                self.store.set_tokens(entry.id, len(tokens))
