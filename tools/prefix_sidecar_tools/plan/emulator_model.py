"""The planner's pod model of an emulated pod: one function, so the two cannot drift.

Field by field (docs/emulator.md, "Time model"): the emulator prefills in `prefill_slots`
FIFO slots at `prefill_tps` tokens/s each plus `prefill_overhead_s`; admits `max_running`
requests FIFO; decodes at `decode_tps` per request; its KV counts prompt blocks only.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex

from prefix_sidecar_tools.emulator.config import (
    EmulatorConfig,
    add_config_arguments,
    config_from_args,
)
from prefix_sidecar_tools.plan.scenario import Pod, ScenarioError


def pod_from_emulator(config: EmulatorConfig, *, overhead_ms: float = 0.0) -> Pod:
    return Pod(
        prefill_tps=config.prefill_tps,
        prefill_overhead_ms=config.prefill_overhead_s * 1e3,
        prefill_slots=config.prefill_slots,
        decode_tps=config.decode_tps,
        max_running=config.max_running,
        kv_tokens=config.kv_tokens,
        gpus=1,
        kv_counts_output=False,  # the emulator's KV holds prompt blocks only
        overhead_ms=overhead_ms,
    )


def pod_from_emulator_flags(flags: str) -> Pod:
    """`--from-emulator "--kv-tokens 150000 --prefill-tps 2000"`: the emulator's own flags,
    parsed by the emulator's own parser (time scale and faults are ignored)."""
    parser = argparse.ArgumentParser(prog="--from-emulator", add_help=False, exit_on_error=False)
    add_config_arguments(parser)
    try:
        args, unknown = parser.parse_known_args(shlex.split(flags))
        if unknown:
            raise ValueError(f"not an emulator flag: {' '.join(unknown)}")
        config = config_from_args(args)
    except (argparse.ArgumentError, ValueError) as exc:
        raise ScenarioError(f"--from-emulator: {exc}") from None
    return pod_from_emulator(dataclasses.replace(config, time_scale=1.0))
