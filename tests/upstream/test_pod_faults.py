"""Pods that break HTTP itself (issue 27: defects 1, 5, 6 and the leniencies), each a real
pod on 127.0.0.1 writing the bytes (prefix_sidecar_tools.attack.pods.RAW_MODES) in front of
a real sidecar with both fronts: no caller gets another's answer, none gets a 500, a 1xx or
a pod's invalid status, and every broken answer fails over to the good pod beside it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from prefix_sidecar.metrics import Metrics
from prefix_sidecar.server.app import Sidecar
from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER
from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.attack.pods import RAW_MODES, UNASKED_TEXT, raw_pod
from prefix_sidecar_tools.attack.runner import prompt_routed_to
from prefix_sidecar_tools.harness import free_port
from tests.server.conftest import running_sidecar, sidecar_config

CALLERS = 12
BROKEN = sorted(mode for mode in RAW_MODES if mode not in ("good", "unasked"))


@contextlib.asynccontextmanager
async def sidecar_with(tmp_path: Path, pods: list[str]) -> AsyncIterator[tuple[str, Sidecar, Any]]:
    """An in-process sidecar over `pods`, with its HTTP front; (front URL, sidecar, stub)."""
    port = free_port()
    config = sidecar_config(tmp_path, pods, openai_listen=f"127.0.0.1:{port}")
    async with running_sidecar(config) as (sidecar, stub):
        yield f"http://127.0.0.1:{port}", sidecar, stub


async def complete(session: aiohttp.ClientSession, front: str, prompt: str) -> tuple[int, str, str]:
    """One caller's completion through the HTTP front: (status, its text or body, pod)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    async with session.post(front + "/v1/completions", json=body) as response:
        raw = await response.read()
        text = raw.decode("utf-8", "replace")
        if response.status == 200:
            text = json.loads(raw)["choices"][0]["text"]
        return response.status, text, response.headers.get(BACKEND_HEADER, "")


def counted(metrics: Metrics, name: str, **labels: str) -> float:
    """The sum of a counter's samples whose labels include `labels`."""
    total = 0.0
    for family in metrics.registry.collect():
        for sample in family.samples:
            wanted = sample.name == name and sample.labels.items() >= labels.items()
            total += sample.value if wanted else 0.0
    return total


async def test_a_second_unasked_answer_never_reaches_another_caller(tmp_path: Path) -> None:
    """Defect 1: the pod answers, then writes a second answer nobody asked for on the same
    keep-alive connection. Every caller gets its own answer; the connection is closed and
    the event counted."""
    async with raw_pod("unasked") as pod, sidecar_with(tmp_path, [pod]) as (front, sidecar, _):
        async with aiohttp.ClientSession() as session:
            answers = [await complete(session, front, f"caller {n}") for n in range(6)]
        closed = counted(sidecar.metrics, "prefix_sidecar_pod_unasked_answers_total", backend=pod)
    assert answers == [(200, f"caller {n}", pod) for n in range(6)], answers
    assert all(UNASKED_TEXT not in text for _, text, _ in answers)
    assert closed >= 1


@pytest.mark.parametrize("mode", BROKEN)
async def test_a_broken_answer_fails_over_to_the_good_pod(tmp_path: Path, mode: str) -> None:
    """Defects 5 and 6 and the leniencies, on the HTTP front: a malformed Content-Length,
    an invalid status, a 1xx as final, a 204 with a body, a lenient chunk size, CL beside
    TE, a control character in a header. Each is the pod's fault: every caller gets a 200
    from the good pod, with its own text; none a 500, none the broken pod's answer."""
    async with (
        raw_pod(mode) as bad,
        raw_pod("good") as good,
        sidecar_with(tmp_path, [bad, good]) as (front, sidecar, stub),
    ):
        # the broken pod a caller's first pick, as the Route RPC names it: two pods on random
        # ports can give it none of a dozen short prompts
        first = await prompt_routed_to(stub, bad, "caller")
        prompts = [first] + [f"caller {n}" for n in range(CALLERS)]
        async with aiohttp.ClientSession() as session:
            answers = [await complete(session, front, prompt) for prompt in prompts]
        moved = counted(sidecar.metrics, "prefix_sidecar_failovers_total", backend=bad)
    assert answers == [(200, prompt, good) for prompt in prompts], answers
    assert moved >= 1


@pytest.mark.parametrize("mode", ["bad_length", "status_99", "interim_5", "unasked"])
async def test_the_grpc_front_fails_over_from_a_broken_pod(tmp_path: Path, mode: str) -> None:
    """The gRPC path keeps failing over from the same pods (defect 5 held there)."""
    async with (
        raw_pod(mode) as bad,
        raw_pod("good") as good,
        sidecar_with(tmp_path, [bad, good]) as (_, _, stub),
    ):
        for n in range(CALLERS):
            request = router_pb2.CompleteRequest(input=f"caller {n}", max_tokens=1)
            chunks = [chunk async for chunk in stub.Complete(request, timeout=10)]
            assert chunks[0].backend == good or mode == "unasked"
            assert "".join(chunk.text for chunk in chunks) == f"caller {n}"


async def test_a_pod_status_99_is_unavailable_on_grpc_not_the_callers_fault(
    tmp_path: Path,
) -> None:
    """Defect 6 on gRPC: status 99 was INVALID_ARGUMENT, "the pod rejected the request"."""
    async with raw_pod("status_99") as bad, sidecar_with(tmp_path, [bad]) as (_, _, stub):
        request = router_pb2.CompleteRequest(input="hello", max_tokens=1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Complete(request, timeout=10):
                pass
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
