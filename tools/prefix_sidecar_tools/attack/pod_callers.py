"""Callers in front of pods that break HTTP (prefix_sidecar_tools.attack.pods.RAW_MODES).

`python -m prefix_sidecar_tools.attack.pod_callers SOCKET OPTIONS_JSON` sends, for each
broken pod, `count` small completions whose prompts route to it first, one after another
(so a kept-alive connection carries the next caller's request), through the HTTP front and
the gRPC front, and prints one JSON line. The broken pods answer each prompt with itself as
the text; a caller is `affected` when its answer's text is another caller's prompt or the
answer nobody asked for, `accepted` when the pod that served it (the sidecar says which) is
one whose framing is broken (the sidecar took a malformed answer for a good one; the unasked
pod's first answers are right), `failed` when it got no 200 at all, and `server_errors`
counts the 500s among those. A sidecar that holds fails every
broken answer over to the healthy pod (an emulator, which writes text of its own): nobody
affected, accepted or failed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from prefix_sidecar.upstream.byte_relay import BACKEND_HEADER
from prefix_sidecar_tools.attack.pods import UNASKED_TEXT

STATUS_OK = 200
SERVER_ERROR = 500


def _tally() -> dict[str, Any]:
    return {
        "callers": 0,
        "affected": 0,
        "accepted": 0,
        "failed": 0,
        "server_errors": 0,
        "statuses": {},
    }


def _count(
    row: dict[str, Any],
    status: str,
    callers: Callers | None = None,
    prompt: str = "",
    text: str = "",
    backend: str = "",
) -> None:
    """One caller's outcome; no `callers` when it got no answer."""
    row["callers"] += 1
    row["statuses"][status] = row["statuses"].get(status, 0) + 1
    if callers is None:
        row["failed"] += 1
        row["server_errors"] += status == str(SERVER_ERROR)
        return
    row["affected"] += callers.stolen(prompt, text)
    row["accepted"] += backend in callers.broken


class Callers:
    """Every prompt sent: an answer whose text is one of them but the caller's own, or the
    unasked answer, reached the wrong caller; one served by a broken pod was accepted."""

    def __init__(self, prompts: dict[str, list[str]], pods: dict[str, str]) -> None:
        self.foreign = {UNASKED_TEXT, *(text for texts in prompts.values() for text in texts)}
        self.broken = {url for mode, url in pods.items() if mode != "unasked"}

    def stolen(self, prompt: str, text: str) -> bool:
        return text != prompt and text in self.foreign


async def _http_caller(
    session: Any, url: str, model: str, prompt: str, callers: Callers, row: dict[str, Any]
) -> None:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            raw = await response.read()
            if response.status != STATUS_OK:
                _count(row, str(response.status))
                return
            text = json.loads(raw)["choices"][0]["text"]
            backend = response.headers.get(BACKEND_HEADER, "")
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError) as exc:
        _count(row, exc.__class__.__name__)
        return
    _count(row, "200", callers, prompt, text, backend)


async def _grpc_caller(stub: Any, prompt: str, callers: Callers, row: dict[str, Any]) -> None:
    import grpc

    from prefix_sidecar.v1 import router_pb2

    request = router_pb2.CompleteRequest(input=prompt, max_tokens=1)
    try:
        chunks = [chunk async for chunk in stub.Complete(request, timeout=15)]
    except grpc.aio.AioRpcError as exc:
        _count(row, exc.code().name)
        return
    text = "".join(chunk.text for chunk in chunks)
    _count(row, "OK", callers, prompt, text, chunks[0].backend if chunks else "")


async def broken_pod_callers(
    socket_path: str, http_url: str, prompts: dict[str, list[str]], pods: dict[str, str]
) -> dict[str, Any]:
    """`prompts`: for each broken pod's mode, the prompts that route to it first; `pods`:
    each mode's URL."""
    import aiohttp
    import grpc

    from prefix_sidecar.v1 import router_pb2_grpc

    started = time.monotonic()
    modes: dict[str, dict[str, Any]] = {}
    timeout = aiohttp.ClientTimeout(total=15)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        grpc.aio.insecure_channel(f"unix://{socket_path}") as channel,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        async with session.get(http_url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]  # the healthy pod's
        callers = Callers(prompts, pods)
        for mode, texts in prompts.items():
            http, rpc = _tally(), _tally()
            for prompt in texts:
                await _http_caller(session, http_url, model, prompt, callers, http)
                await _grpc_caller(stub, prompt, callers, rpc)
            modes[mode] = {"http": http, "grpc": rpc}
    rows = [row for mode in modes.values() for row in mode.values()]
    return {
        "modes": modes,
        "callers": sum(row["callers"] for row in rows),
        "affected": sum(row["affected"] for row in rows),
        "accepted": sum(row["accepted"] for row in rows),
        "failed": sum(row["failed"] for row in rows),
        "server_errors": sum(row["server_errors"] for row in rows),
        "seconds": round(time.monotonic() - started, 2),
        "errors": [],
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    options: dict[str, Any] = json.loads(args[1])
    result = asyncio.run(
        broken_pod_callers(args[0], options["http_url"], options["prompts"], options["pods"])
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
