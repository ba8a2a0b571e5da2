"""Complete and Chat on the wire: plan the call, relay the pod's stream to the caller with
its trace headers, and record the outcome (request_log.py), whatever ends the call.

A coroutine sending with context.write, not an async generator: each generator layer would be
resumed per chunk, the first token's included. A caller that leaves or a server that stops
ends the call as a cancellation with the caller's status, never as an error of ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from prefix_sidecar.abort import RpcAbort
from prefix_sidecar.metrics import FRONT_GRPC, Metrics
from prefix_sidecar.routing.cost import Prefill
from prefix_sidecar.server.common.request_log import record_outcome
from prefix_sidecar.server.common.trace_context import TraceContext
from prefix_sidecar.server.grpc.early_headers import EarlyHeaders
from prefix_sidecar.server.grpc.plan import CHAT, Planner
from prefix_sidecar.upstream import caller
from prefix_sidecar.upstream.delta_exchange import DeltaExchange
from prefix_sidecar.upstream.outcome import RelayOutcome

logger = logging.getLogger("sidecar.requests")


async def stream_reply(
    rpc: str,
    planner_for: Callable[[str], Planner],
    request: Any,
    context: grpc.aio.ServicerContext,
    metrics: Metrics,
) -> None:
    """Find the request's pool by its model (`planner_for`), validate and route (plan),
    relay the pod's stream with the caller's trace headers, and log/measure the outcome."""
    started = time.perf_counter()
    outcome = RelayOutcome()
    branch = prefix_label = ""
    decision_ns: int | None = None  # None: refused before a pod was chosen
    writing = False
    headers = EarlyHeaders(context)
    trace = TraceContext.from_metadata(context.invocation_metadata())
    caller.watch(context)
    try:
        planner = planner_for(request.model)
        outcome.pool = planner.pool
        plan = planner.chat if rpc == CHAT.name else planner.completion
        upstream = await planner.refined(plan(request))
        branch = upstream.decision.branch
        prefix_label = upstream.prefix_label
        decision_ns = upstream.decision.decision_ns
        metrics.child(metrics.decision, FRONT_GRPC, rpc).observe(decision_ns / 1e9)
        relay = planner.relay
        exchange = DeltaExchange(
            relay.client,
            upstream.path,
            upstream.body,
            chat=upstream.chat,
            outcome=outcome,
            max_message_bytes=relay.policy.max_message_bytes,
            on_accepted=headers.send,
            headers=trace.http_headers(),
            raw_events=upstream.raw_events,
        )
        chunks = relay.attempts(
            upstream.decision.preference,
            exchange,
            front=FRONT_GRPC,
            outcome=outcome,
            time_remaining=context.time_remaining,
            forced_first=upstream.decision.forced,
            prefill=Prefill.of(upstream.decision),
        )
        # aclosing: however the call ends, the relay's cleanup (pod connection, in-flight
        # count) runs now, not when the abandoned generator is collected.
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if headers.pending:
                    await headers.settle()
                writing = True
                await context.write(chunk)
                writing = False
    except RpcAbort as exc:
        outcome.status = exc.code.name
        await headers.settle()
        await _abort(context, exc.code, exc.message, outcome)
    except asyncio.CancelledError:
        # grpc cancels the task when the caller cancels or its deadline ends.
        outcome.status = caller.ended_status(context)
        raise
    except Exception as exc:
        if writing:
            # The call ended under us: the caller went away, or the server is stopping.
            outcome.status = caller.ended_status(context)
            if isinstance(exc, grpc.aio.InternalError):
                # Core failed the write: a cancelled call, not our error. grpc logs a
                # cancel at DEBUG, a failed batch as ERROR with a traceback.
                raise asyncio.CancelledError from None
            raise
        outcome.status = "INTERNAL"
        logger.exception("%s failed unexpectedly", rpc)
        await headers.settle()
        await _abort(context, grpc.StatusCode.INTERNAL, f"{rpc}: internal error", outcome)
    finally:
        record_outcome(
            metrics,
            rpc,
            prefix_label,
            branch,
            outcome,
            started,
            trace,
            front=FRONT_GRPC,
            decision_ns=decision_ns,
        )


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, outcome: RelayOutcome
) -> None:
    """End a stream with a status; a caller already gone cannot get one (see stream_reply)."""
    try:
        await context.abort(code, message)
    except grpc.aio.InternalError:
        outcome.status = caller.ended_status(context)
        raise asyncio.CancelledError from None
