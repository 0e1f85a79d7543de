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
import os
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
        self._running: dict[int, str] = {}  # kernel thread id -> the worker's name, while it runs a call

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
                self._running[threading.get_native_id()] = threading.current_thread().name
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
                    self._running.pop(threading.get_native_id(), None)
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

    def in_kernel(self) -> list[str]:
        """What each call still running is waiting on, as /proc shows it: the thread's
        state (D: uninterruptible, inside the driver) and the file of the read or write it
        is in. A thread in a device call cannot be ended from user space — not by a signal,
        not by SIGKILL — until the driver returns, so the process stays in /proc until then."""
        with self._lock:
            running = dict(self._running)
        return [f"{name}: {_waiting_on(tid)}" for tid, name in sorted(running.items())]

    def close(self) -> None:
        """No new calls; idle workers end; stuck ones are abandoned (daemon threads)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._q.put(None)


def _waiting_on(tid: int, proc: str = "/proc/self/task") -> str:
    """`state D, in write on /sys/.../pp_od_clk_voltage` from /proc/self/task/<tid>/{stat,syscall}."""
    task = f"{proc}/{tid}"
    try:
        with open(f"{task}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "ended"
    what = f"state {state}"
    try:
        with open(f"{task}/syscall") as f:
            fields = f.read().split()
    except OSError:
        fields = []
    # the first argument of read/write/pread/pwrite is the file descriptor on every architecture
    if len(fields) > 1 and fields[0].isdigit() and fields[1].startswith("0x"):
        try:
            what += f", in a read or write of {os.readlink(f'/proc/self/fd/{int(fields[1], 16)}')}"
        except OSError:
            what += f", in system call {fields[0]}"
    return what
