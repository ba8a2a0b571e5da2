"""The tooling around the sidecar: the vLLM emulator, benchmarks, workloads, the real-engine
harness, the fuzzer, the attack replay, the demo and the cost model.

`prefix-sidecar serve` and the client verbs never import this package (a test checks it).
It is its own distribution, prefix-sidecar-tools (tools/ in the repository), which
`pip install 'prefix-sidecar[tools]'` installs; the runtime wheel (the container image's)
does not carry it.
"""

from __future__ import annotations

from pathlib import Path

import prefix_sidecar

# The directories holding `prefix_sidecar/` and `prefix_sidecar_tools/`: child processes get
# both on PYTHONPATH, so they import the same code as their parent whether or not (and
# wherever) the packages are installed.
IMPORT_ROOTS = tuple(
    dict.fromkeys(
        str(Path(folder).resolve().parent) for folder in (*prefix_sidecar.__path__, *__path__)
    )
)
# The checkout's root when the tooling runs from one (tools/prefix_sidecar_tools): where the
# vLLM venv and built artifacts live.
REPO_ROOT = str(Path(__file__).resolve().parents[2])
