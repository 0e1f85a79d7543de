"""Blocking hardware calls on daemon threads, so a call stuck in a wedged device can be
abandoned: a read of a card that stopped answering or an OD write the driver never
returns from must not hold up SIGTERM (40 s after SIGTERM the daemon still
ran). The standard pools cannot do that: `concurrent.futures` joins its workers at
interpreter exit and asyncio's default executor is waited for when the loop closes.

`DeviceCalls.run(fn, *args, timeout=)` awaits the call with a deadline; on timeout the
thread is left to finish (or not) on its own and `stuck()` counts it. Workers are
reused; a new one starts only when every worker is busy.

An abandoned call is marked so: code running inside it asks `abandoned()` before each
further step. An apply given up by its timeout was reported unverified; when the driver
answers at last, the thread must not go on staging and committing behind that report.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from typing import Any, Callable


class DeviceCalls:
    def __init__(self, name: str = "gpuguard-device") -> None:
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._busy = 0
        self._n = itertools.count(1)
        self._closed = False
        self.started = 0  # worker threads started so far
        self._local = threading.local()  # the abandon flag of the call this worker runs

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                fut.set_exception(RuntimeError(f"{self.name}: stopping; no new device calls"))
                return fut
            fut.abandon = threading.Event()  # type: ignore[attr-defined]
            self._q.put((fut, fn, args))
            if self._idle > 0:
                self._idle -= 1
            else:
                self.started += 1
                threading.Thread(target=self._work, name=f"{self.name}-{next(self._n)}", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            self._local.abandon = fut.abandon
            with self._lock:
                self._busy += 1
            ok, value = False, None
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        ok, value = True, fn(*args)
                    except BaseException as e:  # handed to the awaiting side
                        value = e
            finally:
                # idle before the result is handed over: the caller's next call (a poll
                # right after a discovery) finds this worker free instead of starting a
                # second thread that then takes turns with this one
                with self._lock:
                    self._busy -= 1
                    closed = self._closed
                    if not closed:
                        self._idle += 1
            if fut.running():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
            if closed:
                return

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run `fn(*args)` on a device thread; asyncio.TimeoutError after `timeout` (the
        thread is abandoned, not killed: Python cannot kill a thread in a syscall)."""
        fut = self.submit(fn, *args)
        wrapped = asyncio.wrap_future(fut)
        if timeout is None:
            return await wrapped
        try:
            return await asyncio.wait_for(wrapped, timeout)
        except asyncio.TimeoutError:
            fut.abandon.set()  # type: ignore[attr-defined]
            raise

    def abandoned(self) -> bool:
        """True inside a call of this pool that its caller gave up on (timed out)."""
        flag = getattr(self._local, "abandon", None)
        return flag is not None and flag.is_set()

    def busy(self) -> int:
        """Calls running now (a call stuck in a device counts until it returns)."""
        with self._lock:
            return self._busy

    def close(self) -> None:
        """No new calls; idle workers end; stuck ones are abandoned (daemon threads)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._q.put(None)
