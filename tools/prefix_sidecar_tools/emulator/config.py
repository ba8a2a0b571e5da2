"""Every knob of one emulated vLLM pod, and the command-line flags that set them.

Defaults reproduce docs/mission.md's H100 pod serving a 72B model (docs/emulator.md): a cold
60k-token prefix prefills in ~3.8 s, a warm request (200 uncached tokens) in ~25 ms.
The dataclasses are tables (prefix_sidecar/fields.py, the sidecar's own config machinery): each
field declares its flag, help and check once, so the flags cannot drift from the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from prefix_sidecar import fields
from prefix_sidecar.fields import above, at_least, one_of, setting

BLOCK_SIZE = 16  # vLLM's default KV block size on GPUs, in tokens (128 on CPUs)
LORA_MODULES_FLAG = "--lora-modules"  # vLLM's: NAME=PATH or JSON, one or more per flag
MAX_BLOCK_SIZE = 16384  # a block is hashed as one slice of 4-byte pieces: <= 64 KiB
FAIL_STATUSES = (429, 500, 503)


def _fail_status(value: int) -> str | None:
    return None if value in FAIL_STATUSES else f"must be one of {FAIL_STATUSES}, got {value}"


def _count_or_null(value: int | None) -> str | None:
    return None if value is None or value >= 0 else "must be >= 0 or null"


def _block_size(value: int) -> str | None:
    return None if 1 <= value <= MAX_BLOCK_SIZE else f"must be in 1..{MAX_BLOCK_SIZE}"


def _message(name: str, reason: str) -> str:
    return f"{name} {reason}"


@dataclass
class Faults:
    """Fault switches; settable at start (CLI) and at run time (POST /admin/faults).

    Durations here are REAL seconds (they exist to test router timeouts), never scaled.
    """

    fail_next: int = setting(
        0, "fail the next N inference requests", flag="--fail-next", check=at_least(0)
    )
    fail_status: int = setting(
        500,
        "HTTP status of injected failures (429/500/503)",
        flag="--fail-status",
        check=_fail_status,
    )
    stall_seconds: float = setting(
        0.0, "real seconds to stall before the first byte", flag="--stall", check=at_least(0)
    )
    tokenize_stall_seconds: float = setting(
        0.0,
        "real seconds POST /tokenize waits before answering (a busy pod's API server)",
        flag="--tokenize-stall",
        check=at_least(0),
    )
    drop_after_chunks: int | None = setting(
        None,
        "abort streams after K chunks",
        flag="--drop-after-chunks",
        kind=int,
        check=_count_or_null,
    )
    malformed_after_chunks: int | None = setting(
        None,
        "break SSE event K+1",
        flag="--malformed-after-chunks",
        kind=int,
        check=_count_or_null,
    )
    unhealthy: bool = setting(False, "GET /health answers 503", flag="--unhealthy")

    def validate(self) -> None:
        fields.validate(self, _message)

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial JSON update; unknown keys and wrong types raise ValueError."""
        known = fields.table(Faults)
        candidate = dataclasses.replace(self)
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {sorted(known)}")
            setattr(candidate, key, _strict(key, value, known[key]))
        candidate.validate()
        for key in changes:
            setattr(self, key, getattr(candidate, key))


def _strict(key: str, value: Any, entry: fields.Entry) -> Any:
    """A JSON value of exactly the field's type (no "3" for 3: the admin API is for programs)."""
    if value is None and entry.default is None:
        return None
    if entry.kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false")
        return value
    if entry.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer")
        return value
    if entry.kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number")
        return float(value)
    raise ValueError(f"cannot set {key}")  # pragma: no cover


@dataclass
class EmulatorConfig:
    """One pod's model: capacity, speeds and the time scale (see docs/emulator.md)."""

    model: str = setting("Qwen2.5-72B-Instruct", "served model name", flag="--model")
    max_model_len: int = setting(
        131072, "max prompt+output tokens of a request", flag="--max-model-len", check=above(0)
    )
    kv_tokens: int = setting(
        400_000,
        "KV cache capacity in tokens (LRU eviction beyond it)",
        flag="--kv-tokens",
        check=above(0),
    )
    block_size: int = setting(
        BLOCK_SIZE,
        "KV block size in tokens: the unit of caching and of cached_tokens (vLLM on CPU: 128)",
        flag="--block-size",
        check=_block_size,
    )
    prefill_tps: float = setting(
        16_000.0, "prefill throughput, tokens/s", flag="--prefill-tps", check=above(0)
    )
    prefill_overhead_s: float = setting(
        0.012,
        "fixed seconds added to each prefill (scheduling, launch)",
        flag="--prefill-overhead",
        check=at_least(0),
    )
    prefill_slots: int = setting(
        1,
        "prefills computed concurrently; 1 = the GPU does one at a time",
        flag="--prefill-slots",
        check=above(0),
    )
    decode_tps: float = setting(
        35.0, "decode tokens/s per running request", flag="--decode-tps", check=above(0)
    )
    max_running: int = setting(
        64, "max running requests; more wait FIFO", flag="--max-running", check=above(0)
    )
    time_scale: float = setting(
        1.0, "divide every modelled duration by this", flag="--time-scale", check=above(0)
    )
    default_max_tokens: int = setting(
        16,
        "completions without max_tokens (vLLM's default)",
        flag="--default-max-tokens",
        check=at_least(1),
    )
    default_chat_max_tokens: int = setting(
        128,
        "chat without max_tokens (vLLM: until EOS)",
        flag="--default-chat-max-tokens",
        check=at_least(1),
    )
    vocab_size: int = setting(
        151_936,
        "token ids are taken mod this (Qwen2.5's vocabulary)",
        flag="--vocab-size",
        check=above(0),
    )
    # vLLM (orca_metrics.py, api_server.py) attaches the endpoint-load-metrics header to
    # non-streaming responses only; this also puts it on streams, as a pod patched to do so.
    load_header_on_streams: bool = setting(
        False,
        "also answer endpoint-load-metrics on streaming responses (vLLM: non-streaming only)",
        flag="--load-header-on-streams",
    )
    kv_events: str = setting(
        "off",
        "publish KV cache events over ZMQ as vLLM's --kv-events-config does: off, map (each "
        "event a map with a type, vLLM since mid-2026) or array (positional, before)",
        flag="--kv-events",
        check=one_of(("off", "map", "array")),
    )
    stats_history: int = setting(
        1000, "recent prefills kept for /admin/stats", flag="--stats-history"
    )
    enable_lora: bool = setting(
        False, "serve LoRA adapters, as vLLM's --enable-lora", flag="--enable-lora"
    )
    # The path is only shown in /v1/models (and keys the adapter's cache, as in vLLM).
    lora_modules: tuple[str, ...] = setting(
        (),
        "LoRA adapters served beside the model (needs --enable-lora): NAME=PATH or vLLM's "
        "JSON {name, path}, one or more a flag",
        flag=LORA_MODULES_FLAG,
        metavar="NAME=PATH",
        repeat=True,
    )
    runtime_lora_updating: bool = setting(
        False,
        "answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: the "
        "environment's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
        flag="--runtime-lora-updating",
    )
    faults: Faults = field(default_factory=Faults)

    def validate(self) -> None:
        fields.validate(self, _message)
        if self.kv_tokens < self.block_size:
            raise ValueError(f"kv_tokens must hold at least one block ({self.block_size} tokens)")
        modules = lora_modules(self.lora_modules)
        if modules and not self.enable_lora:
            # vLLM does not start: "LoRA is not enabled. Use --enable-lora to enable LoRA."
            raise ValueError(f"{LORA_MODULES_FLAG} needs --enable-lora, as vLLM does")
        if self.model in dict(modules):
            raise ValueError(f"a LoRA adapter may not be named as the model ({self.model!r})")
        self.faults.validate()

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // self.block_size


def lora_modules(items: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, path) of each `--lora-modules` item, as vLLM reads them: NAME=PATH, or a
    JSON object with "name" and "path"; raises ValueError on anything else."""
    modules: list[tuple[str, str]] = []
    for item in items:
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
        else:
            try:
                module = json.loads(item)
                name, path = module["name"], module["path"]
            except (ValueError, TypeError, KeyError):
                raise ValueError(f"{LORA_MODULES_FLAG} {item!r}: NAME=PATH or JSON") from None
        if not isinstance(name, str) or not isinstance(path, str) or not name:
            raise ValueError(f"{LORA_MODULES_FLAG} {item!r}: a name and a path")
        modules.append((name, path))
    return modules


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the pod-model and fault flags (shared by `emulate` and `python -m`)."""
    fields.add_flags(parser.add_argument_group("pod model"), EmulatorConfig, typed=True)
    # vLLM's --lora-modules takes several values at once: the table's repeatable flag does
    # too (each use appends a list; config_from_args flattens them).
    parser._option_string_actions[LORA_MODULES_FLAG].nargs = "+"
    faults = parser.add_argument_group("faults (also settable at run time: POST /admin/faults)")
    fields.add_flags(faults, Faults, typed=True)


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """Build and validate a config; raises ValueError with the flag's meaning on bad input."""
    faults = Faults(**fields.given(args, Faults))
    given = fields.given(args, EmulatorConfig)
    if "lora_modules" in given:
        given["lora_modules"] = tuple(item for group in given["lora_modules"] for item in group)
    config = EmulatorConfig(**given, faults=faults)
    config.validate()
    return config


def config_to_argv(config: EmulatorConfig) -> list[str]:
    """The inverse of config_from_args: flags that rebuild `config` in a child process."""
    return to_argv(config) + to_argv(config.faults)


def to_argv(config: Any) -> list[str]:
    """Flags that rebuild `config`'s flagged fields (the inverse of fields.given)."""
    argv: list[str] = []
    for entry in fields.table(type(config)).values():
        value = getattr(config, entry.name)
        if entry.spec.flag is None or value is None:
            continue
        if entry.kind is bool:
            argv += [entry.spec.flag] if value else []
        elif entry.spec.repeat:
            for item in value:
                argv += [entry.spec.flag, str(item)]
        else:
            argv += [entry.spec.flag, str(value)]
    return argv
