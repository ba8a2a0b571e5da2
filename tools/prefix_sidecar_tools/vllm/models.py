"""What real vLLM pods serve here: tiny models and their LoRA adapters, each built once
into .artifacts/ by the vLLM venv's python (tiny_model.py) and reused while its recipe holds.

    model = ensure_tiny_model(python)                    # MODEL_A: .artifacts/vllm-tiny
    model_b = ensure_model(python, MODEL_B)              # .artifacts/vllm-tiny-b, other weights
    adapter = ensure_adapter(python, model, "lora-a")    # .artifacts/vllm-lora/vllm-tiny-lora-a

A second model (issue 30's second pool) shares the first one's tokenizer and shape, with
weights from another seed, and is served under its own name. An adapter is rank 8 on
q_proj and v_proj with random weights (peft's default init is a no-op adapter: B = 0), from
a seed taken from its name, so two adapters of one model compute different things.
"""

from __future__ import annotations

import re
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

from prefix_sidecar_tools import REPO_ROOT
from prefix_sidecar_tools.vllm import tiny_model
from prefix_sidecar_tools.vllm.pod import vllm_env

ARTIFACTS = Path(REPO_ROOT) / ".artifacts"
DEFAULT_MODEL_DIR = ARTIFACTS / "vllm-tiny"
ADAPTERS_DIR = ARTIFACTS / "vllm-lora"
SERVED_MODEL = "tiny-llama"
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class TinyModel:
    """A tiny model: its folder under .artifacts, the name pods serve it as, its weights."""

    folder: str
    served: str
    weights_seed: int

    @property
    def path(self) -> Path:
        return ARTIFACTS / self.folder


MODEL_A = TinyModel("vllm-tiny", SERVED_MODEL, tiny_model.SEED)
MODEL_B = TinyModel("vllm-tiny-b", "tiny-llama-b", 7)


def ensure_tiny_model(
    python: Path,
    out_dir: Path = DEFAULT_MODEL_DIR,
    *,
    weights_seed: int = tiny_model.SEED,
    adapter_of: Path | None = None,
) -> Path:
    """The tiny model's folder (another weights seed: a second model; `adapter_of`: a LoRA
    adapter of that model), built with the vLLM venv's python unless this recipe's build is
    already there (seconds the first time, nothing after)."""
    base = str(adapter_of.resolve()) if adapter_of is not None else ""
    if not tiny_model.is_built(out_dir, weights_seed, base):
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(python), tiny_model.__file__, str(out_dir.resolve())]
        argv += ["--weights-seed", str(weights_seed)]
        if base:
            argv += ["--adapter-of", base]
        done = subprocess.run(argv, env=vllm_env(), capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not tiny_model.is_built(out_dir, weights_seed, base):
            raise RuntimeError(f"building the tiny model failed:\n{done.stderr[-3000:]}")
    return out_dir


def ensure_model(python: Path, model: TinyModel) -> Path:
    """`model`'s folder, built once."""
    return ensure_tiny_model(python, model.path, weights_seed=model.weights_seed)


def adapter_seed(name: str) -> int:
    """The weights seed of the adapter called `name`: the same name, the same weights."""
    return zlib.crc32(name.encode("utf-8"))


def ensure_adapter(
    python: Path, model_dir: Path, name: str, adapters_dir: Path = ADAPTERS_DIR
) -> Path:
    """The folder of a LoRA adapter of the model in `model_dir`, called `name` (the name
    pods serve it as, and its folder's suffix), built once."""
    if not _ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r}: letters, digits, '.', '_' and '-' only")
    out_dir = adapters_dir / f"{model_dir.name}-{name}"
    return ensure_tiny_model(python, out_dir, weights_seed=adapter_seed(name), adapter_of=model_dir)
