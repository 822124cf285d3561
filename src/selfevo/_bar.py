"""rich's progress bar, which also reports to a log. A console that is not a terminal (a batch job's
output sent to a file, a cluster's log) draws no bar: a run of hours would leave nothing there until
it ends (an H200 run of configs/lm-tiny.toml wrote no line in its first 270 seconds)."""

from __future__ import annotations

import threading
import time

import rich.progress
from rich.console import Console


class Progress(rich.progress.Progress):
    """`rich.progress.Progress`, drawn on stderr unless given another console; where its console is not a
    terminal, also a plain line on stderr (stdout may be a command's data) when a task changed (its
    description or count): at most one a task every `every` seconds, a change held back written once that
    is due (so what runs now shows within `every`), then its last state when the display stops. Work shorter
    than `every` writes nothing."""

    def __init__(self, *columns, every: float = 30.0, **kwargs):
        # on stderr unless told otherwise: stdout may be a command's data, and a reader of it that closes
        # early (`| head`) made the bar's last write end the command before it wrote its results
        if kwargs.get("console") is None:
            kwargs["console"] = Console(stderr=True)
        super().__init__(*columns, **kwargs)
        self._log = not self.disable and not self.console.is_terminal
        self._every = every
        self._began = time.monotonic()
        self._logged: dict[rich.progress.TaskID, tuple[float, tuple]] = {}  # task: (its last line's time, state)
        self._err = Console(stderr=True, highlight=False, soft_wrap=True)
        self._log_lock = threading.Lock()

    def update(self, task_id: rich.progress.TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._report(task_id)

    def advance(self, task_id: rich.progress.TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._report(task_id)

    def get_renderables(self):
        # the display's refresh thread calls this several times a second, terminal or not: a change
        # held back by `every` is written here once it is due, with no further update to prompt it
        for task_id in self.task_ids:
            self._report(task_id)
        yield from super().get_renderables()

    def stop(self) -> None:
        for task_id in list(self._logged):
            self._report(task_id, final=True)
        super().stop()

    def _report(self, task_id: rich.progress.TaskID, final: bool = False) -> None:
        if not self._log:
            return
        with self._lock:
            task = self._tasks.get(task_id)  # None: removed (`remove_task`) since it was listed
            if task is None:
                return
            state = (task.description, task.completed)
            elapsed = task.elapsed or 0.0
        # the refresh thread reports too: one line for one change, printed under the lock, so that an
        # older line never lands after a newer one (the last state, at stop, last)
        with self._log_lock:
            now = time.monotonic()
            last, last_state = self._logged.get(task_id, (self._began, None))
            if state == last_state or (not final and now - last < self._every):
                return
            self._logged[task_id] = (now, state)
            count = _count(task.completed) + ("" if task.total is None else f"/{_count(task.total)}")
            self._err.print(f"{time.strftime('%H:%M:%S')} {task.description}: {count} "
                            f"({int(elapsed) // 60}m{int(elapsed) % 60:02d}s)")


def _count(x: float) -> str:
    """A task's count as a log line shows it: 21000000, not 2.1e+07."""
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"
