"""What the real llama.cpp tests share: the skip when llama-cpp-python is not installed,
and the tiny GGUF model the pods load (written once per module, nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefix_sidecar_tools.realengine.gguf_model import write_model
from prefix_sidecar_tools.realengine.pods import llama_cpp_available

needs_llama = pytest.mark.skipif(
    not llama_cpp_available(),
    reason="llama-cpp-python[server] is not installed, so there is no llama.cpp pod to run "
    "(see docs/real-engine.md, Install)",
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "tiny.gguf")
