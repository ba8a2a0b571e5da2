"""Every knob of one emulated vLLM pod, and the command-line flags that set them.

Defaults reproduce the note's H100 pod serving a 72B model (docs/emulator.md): a cold
60k-token prefix prefills in ~3.8 s, a warm request (200 uncached tokens) in ~25 ms.
The CLI flags and the dataclass are built from one table so they cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

BLOCK_SIZE = 16  # vLLM's default KV block size, in tokens
FAIL_STATUSES = (429, 500, 503)


@dataclass
class Faults:
    """Fault switches; settable at start (CLI) and at run time (POST /admin/faults).

    Durations here are REAL seconds (they exist to test router timeouts), never scaled.
    """

    fail_next: int = 0  # fail the next N inference requests with `fail_status`
    fail_status: int = 500  # 429, 500 or 503
    stall_seconds: float = 0.0  # wait this long before the first byte of every response
    drop_after_chunks: int | None = None  # streaming: close the socket after K data events
    malformed_after_chunks: int | None = None  # streaming: event K+1 is broken JSON
    unhealthy: bool = False  # GET /health answers 503

    def validate(self) -> None:
        if self.fail_next < 0:
            raise ValueError("fail_next must be >= 0")
        if self.fail_status not in FAIL_STATUSES:
            raise ValueError(f"fail_status must be one of {FAIL_STATUSES}, got {self.fail_status}")
        if self.stall_seconds < 0:
            raise ValueError("stall_seconds must be >= 0")
        for name in ("drop_after_chunks", "malformed_after_chunks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or null")

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial JSON update; unknown keys and wrong types raise ValueError."""
        known = {f.name: f for f in dataclasses.fields(self)}
        candidate = dataclasses.replace(self)
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {sorted(known)}")
            setattr(candidate, key, _coerce(key, value, known[key].type))
        candidate.validate()
        for key in changes:
            setattr(self, key, getattr(candidate, key))


def _coerce(key: str, value: Any, type_name: Any) -> Any:
    type_text = str(type_name)
    if value is None and "None" in type_text:
        return None
    if type_text.startswith("bool"):
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false")
        return value
    if type_text.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer")
        return value
    if type_text.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number")
        return float(value)
    raise ValueError(f"cannot set {key}")


@dataclass
class EmulatorConfig:
    """One pod's model: capacity, speeds and the time scale (see docs/emulator.md)."""

    model: str = "Qwen2.5-72B-Instruct"
    max_model_len: int = 131072
    kv_tokens: int = 400_000  # KV capacity for prompt blocks, in tokens (LRU beyond it)
    prefill_tps: float = 16_000.0  # prefill throughput of the pod, tokens/s
    prefill_overhead_s: float = 0.012  # fixed cost of a prefill step (scheduling, launch)
    prefill_slots: int = 1  # prefills computed at once; 1 = the GPU does one at a time
    decode_tps: float = 35.0  # output tokens/s for each running request
    max_running: int = 64  # running requests; more wait in a FIFO queue
    time_scale: float = 1.0  # every modelled duration is divided by this
    default_max_tokens: int = 16  # /v1/completions without max_tokens (vLLM's default)
    default_chat_max_tokens: int = 128  # chat without max_tokens (vLLM: until EOS)
    vocab_size: int = 151_936  # Qwen2.5's vocabulary size; token ids are mod this
    stats_history: int = 1000  # how many recent prefills /admin/stats keeps
    faults: Faults = field(default_factory=Faults)

    def validate(self) -> None:
        positive = ("max_model_len", "kv_tokens", "prefill_tps", "decode_tps", "max_running")
        for name in (*positive, "prefill_slots", "time_scale", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_tokens < BLOCK_SIZE:
            raise ValueError(f"kv_tokens must hold at least one block ({BLOCK_SIZE} tokens)")
        if self.prefill_overhead_s < 0:
            raise ValueError("prefill_overhead_s must be >= 0")
        if self.default_max_tokens < 1 or self.default_chat_max_tokens < 1:
            raise ValueError("default max tokens must be >= 1")
        self.faults.validate()

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // BLOCK_SIZE


# flag name -> (config attribute, type, help); faults have their own table below.
_CONFIG_FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model", str, "served model name"),
    ("--max-model-len", "max_model_len", int, "max prompt+output tokens of a request"),
    ("--kv-tokens", "kv_tokens", int, "KV cache capacity in tokens (LRU eviction beyond it)"),
    ("--prefill-tps", "prefill_tps", float, "prefill throughput, tokens/s"),
    ("--prefill-overhead", "prefill_overhead_s", float, "fixed seconds added to each prefill"),
    ("--prefill-slots", "prefill_slots", int, "prefills computed concurrently"),
    ("--decode-tps", "decode_tps", float, "decode tokens/s per running request"),
    ("--max-running", "max_running", int, "max running requests; more wait FIFO"),
    ("--time-scale", "time_scale", float, "divide every modelled duration by this"),
    ("--default-max-tokens", "default_max_tokens", int, "completions without max_tokens"),
    ("--default-chat-max-tokens", "default_chat_max_tokens", int, "chat without max_tokens"),
    ("--vocab-size", "vocab_size", int, "token ids are taken mod this"),
    ("--stats-history", "stats_history", int, "recent prefills kept for /admin/stats"),
]
_FAULT_FLAGS: list[tuple[str, str, type, str]] = [
    ("--fail-next", "fail_next", int, "fail the next N inference requests"),
    ("--fail-status", "fail_status", int, "HTTP status of injected failures (429/500/503)"),
    ("--stall", "stall_seconds", float, "real seconds to stall before the first byte"),
    ("--drop-after-chunks", "drop_after_chunks", int, "abort streams after K chunks"),
    ("--malformed-after-chunks", "malformed_after_chunks", int, "break SSE event K+1"),
]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the pod-model and fault flags (shared by `emulate` and `python -m`)."""
    defaults = EmulatorConfig()
    group = parser.add_argument_group("pod model")
    for flag, attr, kind, text in _CONFIG_FLAGS:
        default = getattr(defaults, attr)
        group.add_argument(flag, dest=attr, type=kind, default=default, help=f"{text} ({default})")
    faults = parser.add_argument_group("faults (also settable at run time: POST /admin/faults)")
    for flag, attr, kind, text in _FAULT_FLAGS:
        faults.add_argument(
            flag, dest=attr, type=kind, default=getattr(defaults.faults, attr), help=text
        )
    faults.add_argument("--unhealthy", action="store_true", help="GET /health answers 503")


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """Build and validate a config; raises ValueError with the flag's meaning on bad input."""
    faults = Faults(
        **{attr: getattr(args, attr) for _, attr, _, _ in _FAULT_FLAGS},
        unhealthy=bool(args.unhealthy),
    )
    config = EmulatorConfig(
        **{attr: getattr(args, attr) for _, attr, _, _ in _CONFIG_FLAGS}, faults=faults
    )
    config.validate()
    return config


def config_to_argv(config: EmulatorConfig) -> list[str]:
    """The inverse of config_from_args: flags that rebuild `config` in a child process."""
    argv: list[str] = []
    for flag, attr, _, _ in _CONFIG_FLAGS:
        argv += [flag, str(getattr(config, attr))]
    for flag, attr, _, _ in _FAULT_FLAGS:
        value = getattr(config.faults, attr)
        if value is not None:
            argv += [flag, str(value)]
    if config.faults.unhealthy:
        argv.append("--unhealthy")
    return argv
