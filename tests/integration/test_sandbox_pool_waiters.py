"""SandboxPool's waiter queue with real sandboxes (the `process` backend: real agent processes,
no root needed): waiters are served in arrival order, a released sandbox wakes one waiter and not
all of them, a waiter cancelled just as it was handed a sandbox passes it on, stop() fails the
waiters at once, and a single-use pool at its cap admits a waiter when a destroy finishes."""

from __future__ import annotations

import asyncio
import time

import pytest

from slipstream.sandbox.base import SandboxTemplate
from slipstream.sandbox.errors import SandboxError
from slipstream.sandbox.pool import PoolOptions, SandboxPool

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def one_slot_pool(tmp_path, **kw) -> SandboxPool:
    """At most one live sandbox, none kept warm unless handed back: every acquirer but one waits."""
    opts = {"min_idle": 0, "max_idle": 1, "max_live": 1, "max_density": 64.0, "reuse": True, **kw}
    return SandboxPool(SandboxTemplate(backend="process"), PoolOptions(**opts), state_dir=tmp_path)


async def queue_waiters(pool: SandboxPool, n: int, order: list[int]) -> list[asyncio.Task]:
    async def waiter(i: int) -> None:
        sb = await pool.acquire(timeout_s=60)
        order.append(i)
        await pool.release(sb)

    tasks = []
    for i in range(n):
        tasks.append(asyncio.ensure_future(waiter(i)))
        await asyncio.sleep(0.005)  # each one queued before the next arrives
    return tasks


def test_waiters_are_served_in_arrival_order(tmp_path):
    async def go():
        async with one_slot_pool(tmp_path) as pool:
            sb = await pool.acquire()
            order: list[int] = []
            tasks = await queue_waiters(pool, 6, order)
            assert order == [] and len(pool._waiters) == 6
            await pool.release(sb)
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert order == list(range(6))
            st = pool.stats()
            assert st.created == 1 and st.acquires == 7  # one sandbox, handed on seven times
        assert pool.journal.entries() == []

    asyncio.run(go())


def test_a_release_wakes_one_waiter_not_all(tmp_path):
    async def go():
        async with one_slot_pool(tmp_path) as pool:
            sb = await pool.acquire()
            held: list[asyncio.Future] = []

            async def hold() -> None:
                got = await pool.acquire(timeout_s=60)
                held.append(got)

            tasks = []
            for _ in range(20):
                tasks.append(asyncio.ensure_future(hold()))
            await asyncio.sleep(0.05)
            looks = 0
            admissible = pool._admissible

            def counting() -> bool:
                nonlocal looks
                looks += 1
                return admissible()

            pool._admissible = counting  # type: ignore[method-assign]
            await pool.release(sb)
            await asyncio.sleep(0.2)
            # One waiter got the sandbox; the other 19 never ran (a wake-all condition makes each
            # of them look at admission again on every change).
            assert len(held) == 1 and held[0] is sb
            assert sum(t.done() for t in tasks) == 1
            assert looks <= 1, looks
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pool.release(sb)

    asyncio.run(go())


def test_a_waiter_cancelled_as_it_is_handed_a_sandbox_passes_it_on(tmp_path):
    async def go():
        async with one_slot_pool(tmp_path) as pool:
            sb = await pool.acquire()
            first = asyncio.ensure_future(pool.acquire(timeout_s=60))
            await asyncio.sleep(0.01)
            second = asyncio.ensure_future(pool.acquire(timeout_s=60))
            await asyncio.sleep(0.01)
            await pool.release(sb)  # handed to `first`, which has not run since
            first.cancel()
            got = await asyncio.wait_for(second, 30)
            assert got is sb
            with pytest.raises(asyncio.CancelledError):
                await first
            st = pool.stats()
            assert st.in_use == 1 and st.idle == 0 and st.live == 1
            await pool.release(got)
            assert pool.stats().idle == 1

    asyncio.run(go())


def test_stop_fails_waiters_at_once(tmp_path):
    async def go():
        pool = await one_slot_pool(tmp_path).start()
        await pool.acquire()
        waiters = [asyncio.ensure_future(pool.acquire(timeout_s=120)) for _ in range(3)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await pool.stop()
        results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 10)
        assert time.monotonic() - t0 < 10
        assert all(isinstance(r, SandboxError) and "stopping" in str(r) for r in results)
        assert pool.stats().live == 0 and pool.journal.entries() == []

    asyncio.run(go())


def test_single_use_pool_at_its_cap_admits_a_waiter_after_the_destroy(tmp_path):
    async def go():
        async with one_slot_pool(tmp_path, reuse=False, max_idle=0) as pool:
            sb = await pool.acquire()
            waiter = asyncio.ensure_future(pool.acquire(timeout_s=60))
            await asyncio.sleep(0.05)
            assert not waiter.done()
            await pool.release(sb)  # destroyed in the background; its end wakes the waiter
            fresh = await asyncio.wait_for(waiter, 60)
            assert fresh is not sb
            st = pool.stats()
            assert st.created == 2 and st.destroyed == 1 and st.live == 1
            await pool.release(fresh)
        assert pool.journal.entries() == []

    asyncio.run(go())


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "single-use"])
def test_waiters_timing_out_and_cancelled_at_random_lose_nothing(tmp_path, reuse):
    """40 callers on a 2-sandbox pool, each with a random timeout (some too short to be served),
    some cancelled at a random moment: every caller with a long timeout that was not cancelled is
    served, the others time out or are cancelled; afterwards nothing is in use, the live count is
    what the pool holds, and stop() leaves the journal empty."""
    import random

    from slipstream.sandbox.errors import AdmissionTimeout

    rng = random.Random(7)

    async def go():
        pool = await one_slot_pool(tmp_path, reuse=reuse, max_live=2, max_idle=2).start()
        outcomes: dict[int, str] = {}

        async def caller(i: int, timeout_s: float) -> None:
            try:
                sb = await pool.acquire(timeout_s=timeout_s)
            except AdmissionTimeout:
                outcomes[i] = "timeout"
                return
            try:
                assert (await sb.exec(["true"])).exit_code == 0
                await asyncio.sleep(rng.uniform(0, 0.02))
            finally:
                await pool.release(sb)
            outcomes[i] = "served"

        timeouts_s = [rng.choice([0.01, 0.05, 30.0, 30.0]) for _ in range(40)]
        tasks = []
        for i, timeout_s in enumerate(timeouts_s):
            tasks.append(asyncio.ensure_future(caller(i, timeout_s)))
            await asyncio.sleep(rng.uniform(0, 0.005))
        cancel = set(rng.sample(range(40), 10))  # wherever they are: waiting, handed, in exec
        for i in cancel:
            tasks[i].cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        errors = [r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)]
        assert not errors
        for i, timeout_s in enumerate(timeouts_s):
            if isinstance(results[i], asyncio.CancelledError):
                assert i in cancel and i not in outcomes
            elif timeout_s == 30.0:
                assert outcomes[i] == "served", (i, outcomes.get(i))
            else:
                assert outcomes[i] in ("served", "timeout")
        assert sum(o == "served" for o in outcomes.values()) >= 10
        deadline = time.monotonic() + 30  # single use: the last destroys run in the background
        while time.monotonic() < deadline and (
            pool.stats().live != pool.stats().idle or pool._creating
        ):
            await asyncio.sleep(0.05)
        st = pool.stats()
        assert st.in_use == 0 and st.live == st.idle <= 2 and not pool._waiters
        await pool.stop()
        assert pool.stats().live == 0 and pool.journal.entries() == []

    asyncio.run(go())


def test_a_caller_cancelled_during_release_or_health_check_strands_nothing(tmp_path):
    """The leak the random test once found (in_use=1 with every caller gone): a caller cancelled
    while its sandbox resets in release(), or while acquire() pings a reused one, must leave the
    sandbox to the pool, not counted in use forever."""

    async def settle(pool: SandboxPool) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (pool.stats().in_use or pool._tasks):
            await asyncio.sleep(0.01)

    async def go():
        async with one_slot_pool(tmp_path, health_check=True) as pool:
            sb = await pool.acquire()
            releasing = asyncio.ensure_future(pool.release(sb))
            await asyncio.sleep(0)  # the reset has started
            releasing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await releasing
            await settle(pool)
            st = pool.stats()
            assert (st.in_use, st.idle) == (0, 1)

            acquiring = asyncio.ensure_future(pool.acquire())
            await asyncio.sleep(0)  # taken from the idle set, now in its health check
            assert pool.stats().in_use == 1
            acquiring.cancel()
            with pytest.raises(asyncio.CancelledError):
                await acquiring
            await settle(pool)
            st = pool.stats()
            assert (st.in_use, st.idle, st.created) == (0, 1, 1)
            again = await pool.acquire(timeout_s=30)  # and it is served again
            assert again is sb
            await pool.release(again)
        assert pool.journal.entries() == []

    asyncio.run(go())
