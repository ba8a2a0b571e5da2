"""Which pool a request's model goes to: the sidecar's pools, looked up by model name.

A pool answers to its configured model names (aliases included) and to the LoRA adapters its
pods report (`ModelPool.adapters`, from /v1/models). No model: the first pool; a config
without `pools` has one pool that takes any model. An unknown name raises `UnknownModel`
(NOT_FOUND on gRPC, 404 on HTTP) listing the known names, so a typo is fixed from the message.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prefix_sidecar.server.model_pool import ModelPool

# The names listed in an unknown model's message: enough to spot a typo, bounded.
LISTED_MODELS = 20
# A caller's name is echoed clipped to this.
ECHOED_CHARS = 100


class UnknownModel(LookupError):
    """A request named a model no pool serves."""

    def __init__(self, model: str, known: Sequence[str]) -> None:
        listed = ", ".join(known[:LISTED_MODELS])
        more = f" and {len(known) - LISTED_MODELS} more" if len(known) > LISTED_MODELS else ""
        super().__init__(
            f"model {model[:ECHOED_CHARS]!r} is not served here; this sidecar serves: "
            f"{listed}{more}"
        )


class Pools:
    """The sidecar's pools in config order; the first is the default."""

    def __init__(self, pools: Sequence[ModelPool], any_model: bool) -> None:
        """`any_model`: the one pool of a config without `pools` takes every name."""
        if not pools:
            raise ValueError("a sidecar has at least one pool")
        self._pools = tuple(pools)
        self._any_model = any_model
        self._by_model = {model: pool for pool in pools for model in pool.models}

    @property
    def default(self) -> ModelPool:
        return self._pools[0]

    def __iter__(self) -> Iterator[ModelPool]:
        return iter(self._pools)

    def __len__(self) -> int:
        return len(self._pools)

    def for_model(self, model: str) -> ModelPool:
        """The pool serving `model` ("": the default); UnknownModel when none does."""
        if not model or self._any_model:
            return self._pools[0]
        pool = self._by_model.get(model)
        if pool is not None:
            return pool
        for pool in self._pools:
            if model in pool.adapters:
                return pool
        raise UnknownModel(model, self.known_models())

    def known_models(self) -> list[str]:
        """Every name a request may give: each pool's models, then its pods' adapters."""
        names = [model for pool in self._pools for model in pool.models]
        for pool in self._pools:
            names.extend(sorted(name for name in pool.adapters if name not in names))
        return names

    def serving(self, url: str) -> ModelPool | None:
        """The pool a pod belongs to (the first, if a URL is in several)."""
        for pool in self._pools:
            if url in pool.pool.backends:
                return pool
        return None
