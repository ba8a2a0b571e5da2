"""The tooling around the sidecar: the vLLM emulator, benchmarks, workloads, the real-engine
harness, the fuzzer, the attack replay, the demo and the cost model.

`prefix-sidecar serve` and the client verbs never import this package (a test checks it).
Its extra dependencies come with `pip install 'prefix-sidecar[tools]'`; a runtime-only build
(the container image) leaves the package out altogether.
"""

from __future__ import annotations

from pathlib import Path

# The directory holding `sidecar/`: child processes get it on PYTHONPATH, so they import the
# same code as their parent whether or not the package is installed.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
