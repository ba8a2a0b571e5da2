"""The fuzz target: one emulator pod and one `prefix-sidecar serve` process."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from prefix_sidecar.v1 import router_pb2
from prefix_sidecar_tools.emulator.fleet import start_emulator_blocking
from prefix_sidecar_tools.fuzz.cases import MODEL, RESPONSES, SERVICE, Known, Limits
from prefix_sidecar_tools.harness import (
    serve_command,
    spawn_blocking,
    terminate_blocking,
)

# --- the target: one emulator pod and one sidecar ------------------------------------------


class FuzzTarget:
    """An emulator pod and a sidecar, each a real `prefix-sidecar` process on 127.0.0.1, dialed
    through a blocking channel: hypothesis drives plain functions, a crash shows as a dead
    process, and the sidecar's stderr (its INFO log) is kept in `log_path` for inspection."""

    def __init__(self, limits: Limits | None = None, time_scale: float = 10_000.0) -> None:
        self.limits = limits or Limits()
        self.time_scale = time_scale
        self.url = ""
        self.known = Known((), ())
        self._dir = tempfile.TemporaryDirectory(prefix="psfuzz-")
        self.target = f"unix://{self._dir.name}/sidecar.sock"
        self.log_path = Path(self._dir.name) / "sidecar.log"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.channel: grpc.Channel | None = None

    def __enter__(self) -> FuzzTarget:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        self.url = start_emulator_blocking(
            self.processes, "--model", MODEL, "--time-scale", str(self.time_scale)
        )
        settings_ = {
            "health_interval_s": 0.5,
            "first_token_timeout_s": 5,
            "grace_s": 1,
            "max_prefixes": 100_000,
            "max_prefix_bytes": self.limits.max_prefix_bytes,
            "max_input_bytes": self.limits.max_input_bytes,
            "max_message_bytes": self.limits.max_message_bytes,
        }
        args = ["--backend", self.url]
        for name, value in settings_.items():
            args += ["--set", f"{name}={value}"]
        with open(self.log_path, "wb") as log:
            self.processes.append(
                spawn_blocking(serve_command(self.target, args), stdout=log, stderr=log)
            )
        self.channel = grpc.insecure_channel(
            self.target, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
        try:
            grpc.channel_ready_future(self.channel).result(timeout=20)
        except grpc.FutureTimeoutError:
            raise RuntimeError(f"the sidecar did not start: {self.log_path.read_text()}") from None
        self._wait_serving()
        self.known = self._register_known()

    def __exit__(self, *exc: object) -> None:
        if self.channel is not None:
            self.channel.close()
        for process in reversed(self.processes):
            terminate_blocking(process, 15)
        self.processes.clear()

    def cleanup(self) -> None:
        self._dir.cleanup()

    def alive(self) -> bool:
        return bool(self.processes) and all(p.poll() is None for p in self.processes)

    def unary(self, rpc: str, request: Any, timeout: float = 10.0) -> Any:
        assert self.channel is not None
        call = self.channel.unary_unary(
            SERVICE + rpc,
            request_serializer=type(request).SerializeToString,
            response_deserializer=RESPONSES[rpc].FromString,
        )
        return call(request, timeout=timeout)

    def stream(self, rpc: str, request: Any, timeout: float = 10.0) -> list[Any]:
        assert self.channel is not None
        call = self.channel.unary_stream(
            SERVICE + rpc,
            request_serializer=type(request).SerializeToString,
            response_deserializer=RESPONSES[rpc].FromString,
        )
        return list(call(request, timeout=timeout))

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            reply = self.unary("ListBackends", router_pb2.ListBackendsRequest())
            if [b.state for b in reply.backends] == ["serving"]:
                return
            time.sleep(0.05)
        raise RuntimeError("the emulator pod never became serving")

    def _register_known(self) -> Known:
        texts = {
            "known-rules": "You are a careful compliance assistant. Rule: cite sources. " * 40,
            "known-short": "Be brief. ",
        }
        ids = [
            self.unary("RegisterPrefix", router_pb2.RegisterPrefixRequest(name=n, text=t)).id
            for n, t in texts.items()
        ]
        return Known(tuple(ids), tuple(texts))

    def probe(self) -> None:
        """A known-good Route and Complete must still work; scratch prefixes are dropped so
        the store stays small however long the fuzz runs."""
        name = self.known.names[0]
        route = self.unary("Route", router_pb2.RouteRequest(prefix_name=name))
        assert route.backend == self.url, f"probe Route answered {route}"
        request = router_pb2.CompleteRequest(prefix_name=name, input="ping", max_tokens=2)
        chunks = self.stream("Complete", request)
        assert chunks and chunks[0].backend == self.url, f"probe Complete answered {chunks}"
        assert chunks[-1].usage.completion_tokens >= 1, f"probe Complete usage {chunks[-1]}"
        for prefix in self.unary("ListPrefixes", router_pb2.ListPrefixesRequest()).prefixes:
            if prefix.id not in self.known.ids:
                with contextlib.suppress(grpc.RpcError):  # a name may cover several ids
                    self.unary(
                        "UnregisterPrefix", router_pb2.UnregisterPrefixRequest(prefix_id=prefix.id)
                    )
