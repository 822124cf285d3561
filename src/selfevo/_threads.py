"""A thread pool whose threads do not hold up this process's exit."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class DaemonThreads(Executor):
    """`concurrent.futures.ThreadPoolExecutor` (submit, map, shutdown, the with-block) on daemon threads.

    That pool's threads are joined when the interpreter exits, so Ctrl-C or SIGTERM waited for every call
    in flight: an HTTP call up to its timeout (a remote agent's: 120 s), a retrieval a server had given up
    on for as long as it ran. Leaving the with-block by an exception cancels the calls not started; by an
    interrupt (KeyboardInterrupt, SystemExit) it waits for none, else for those running, as that pool does.
    Threads are started as calls come, up to `max_workers`, and an idle one is reused first."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "daemon"):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max, self._prefix = max_workers, thread_name_prefix
        self._work: queue.SimpleQueue = queue.SimpleQueue()  # (future, call, args, kwargs); None: end
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # released by each thread as it finishes a call
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future = Future()
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                thread = threading.Thread(target=self._worker, name=f"{self._prefix}_{len(self._threads)}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)
            return future

    def _worker(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args, kwargs = item
            del item  # (a finished call's arguments and result are not kept alive by an idle thread)
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - the caller's, through the future, as the pool does
                    future.set_exception(e)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if cancel_futures:  # the calls not started (a started one cannot be stopped)
                ends = 0
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:  # an earlier shutdown's: put back, for the threads to end on
                        ends += 1
                    else:
                        item[0].cancel()
                for _ in range(ends):
                    self._work.put(None)
            if not self._shut:
                self._shut = True
                for _ in self._threads:
                    self._work.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def __exit__(self, exc_type, exc, tb) -> bool:
        # Ctrl-C; SIGTERM as `experiments.terminate_raises` raises it
        interrupted = exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, SystemExit))
        self.shutdown(wait=not interrupted, cancel_futures=exc_type is not None)
        return False
