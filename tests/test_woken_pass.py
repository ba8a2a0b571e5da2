"""WokenPass: wake-ups during a pass coalesce into one more pass; `busy` and `idle` tell what
waits for it (a registration waits for its prefix's count) when the passes asked for end."""

from __future__ import annotations

import asyncio

from prefix_sidecar.lifecycle import WokenPass


class Recorded(WokenPass):
    def __init__(self) -> None:
        super().__init__()
        self.passes = 0
        self.gate = asyncio.Event()

    async def run_pass(self) -> None:
        self.passes += 1
        await self.gate.wait()


async def test_idle_waits_for_the_passes_asked_for_and_tells_its_watchers_once() -> None:
    woken = Recorded()
    idled: list[int] = []
    woken.idle_watchers.append(lambda: idled.append(woken.passes))
    task = asyncio.create_task(woken.run())
    try:
        assert not woken.busy and await woken.idle(0.01)
        woken.wake()
        assert woken.busy
        await asyncio.sleep(0)
        woken.wake()  # during the pass: one more pass, not two
        woken.wake()
        assert not await woken.idle(0.05)  # the pass is held: not idle by the deadline
        woken.gate.set()
        assert await woken.idle(1.0)
        assert (woken.passes, idled) == (2, [2])
        assert not woken.busy
    finally:
        task.cancel()
