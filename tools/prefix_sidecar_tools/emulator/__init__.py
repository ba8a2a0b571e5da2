"""A vLLM-compatible pod emulator: same HTTP API, SSE format and metrics, modelled timing.

To a router it looks like vLLM (OpenAI API, /health, /tokenize, /metrics); inside it
models a prefix-cached H100: chained blocks (16 tokens, `--block-size`) with LRU eviction,
prefill time proportional to UNCACHED tokens, per-request decode speed, a running limit
with a FIFO queue, a time scale, and switchable faults. Details: docs/emulator.md.

Python API (stable; used by tests, the demo and the benches):

    from prefix_sidecar_tools.emulator import (
        EmulatorConfig, EmulatorFleet, run_emulator, set_faults)

    config = EmulatorConfig(time_scale=50, kv_tokens=200_000)   # every knob, see config.py

    async with run_emulator(config, port=0) as url:     # in-process, 127.0.0.1, free port
        ...                                             # url == "http://127.0.0.1:PORT"

    async with EmulatorFleet(3, config, base_port=0) as fleet:   # 3 real processes
        fleet.urls                      # ["http://127.0.0.1:P0", ...]
        fleet.kill(1)                   # SIGKILL now; `await fleet.kill(1)` also waits reaping
        await fleet.restart(1)          # same port, cold cache
        await set_faults(fleet.urls[0], fail_next=2, fail_status=503)
        await get_stats(fleet.urls[0])  # counters + recent prefills (GET /admin/stats)
        await reset_cache(fleet.urls[0])

Command line: `prefix-sidecar emulate --pods N --base-port P ...` (a fleet) or
`python -m prefix_sidecar_tools.emulator --port P ...` (one pod).
"""

from prefix_sidecar_tools.emulator.app import make_app, run_emulator
from prefix_sidecar_tools.emulator.config import BLOCK_SIZE, EmulatorConfig, Faults
from prefix_sidecar_tools.emulator.fleet import EmulatorFleet, get_stats, reset_cache, set_faults

__all__ = [
    "BLOCK_SIZE",
    "EmulatorConfig",
    "EmulatorFleet",
    "Faults",
    "get_stats",
    "make_app",
    "reset_cache",
    "run_emulator",
    "set_faults",
]
