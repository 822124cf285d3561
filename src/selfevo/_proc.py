"""Subprocesses that stop with this process, their descendants included.

`subprocess.run` kills only its direct child when it is interrupted. A training job's child is a
launcher (`accelerate launch`, `torchrun`, `bash` running verl's script) whose own children do the
training, and `vllm serve` runs engine processes: killed alone, the child leaves them orphaned, still
writing into the run a resume is about to take, or holding the GPU. So stopping a job (Ctrl-C,
SIGTERM raised by `experiments.terminate_raises`, an error) signals the whole tree of processes it
started, found by their parent links in /proc before any is signalled (a parent's death hands its
children to init, out of reach), torchrun's workers included, which it starts in sessions of their
own: SIGTERM, then SIGKILL to what is left after a grace period, or at once if the stop is itself
interrupted (a second Ctrl-C or SIGTERM). A process is signalled only while it is the one found (its
start time unchanged), never a process that took a freed pid.

A launcher that exits by itself (an error, say) while its workers still run hands them to init, where
no parent link finds them any more. So the tree is also recorded while the job runs (every
`WATCH_INTERVAL` seconds), and what of it outlives the job's own process is stopped with a warning,
however the job ended.

The job stays in this process's group and session, so what a terminal sends (Ctrl-C, Ctrl-Z,
Ctrl-\\, a hang-up) reaches it as before. Without /proc (macOS) only the direct child is stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

WATCH_INTERVAL = 1.0  # seconds between looks at a running job's tree (a /proc scan: milliseconds)
KILL_WAIT = 10.0  # seconds a stop waits for the processes it killed to be gone


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a process from /proc; None if there is none."""
    try:  # bytes: the name before ")" is any process's, cut at 15 bytes (a UTF-8 character split, say)
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0].decode(), fields[19].decode()


def process_tree(*roots: int) -> dict[int, str]:
    """`roots` and every process descended from them, by parent links (one pass over /proc): pid ->
    start time ("" for a root /proc does not show)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
                children.setdefault(st[0], []).append(int(entry.name))
                starts[int(entry.name)] = st[2]
    tree, todo = {}, list(roots)
    while todo:
        p = todo.pop()
        if p not in tree and (p in roots or p in starts):
            tree[p] = starts.get(p, "")
            todo.extend(children.get(p, []))
    return tree


def _running(pid: int, start: str) -> bool:
    """The process found, still there and no zombie (start "": without /proc, as far as kill tells)."""
    if not start:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    st = _stat(pid)
    return st is not None and st[2] == start and st[1] != "Z"


def _signal(tree: Mapping[int, str], signum: int) -> None:
    for pid, start in tree.items():
        if _running(pid, start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


class Watch:
    """The processes `proc` and its descendants have been, recorded every `interval` seconds on a
    thread while the job runs (pid -> start time). `proc`: a Popen, or what has its `pid`, `args`,
    `returncode`, `poll()` and `wait(timeout)` (a grid's job process, `experiments._JobProcess`)."""

    def __init__(self, proc: subprocess.Popen, interval: float):
        self.proc, self.seen = proc, process_tree(proc.pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(interval,), daemon=True, name="proc-watch")
        self._thread.start()

    def _watch(self, interval: float) -> None:
        pid = self.proc.pid
        while not self._done.wait(interval) and self.proc.poll() is None:
            tree = process_tree(pid)
            if tree.get(pid) == self.seen[pid]:  # not another process that took the pid once it was reaped
                # the live tree's start times win: a pid an earlier descendant held is a new process's now
                self.seen = {**self.seen, **tree}

    def close(self) -> dict[int, str]:
        """Stop watching; the tree as recorded and as it is now."""
        self._done.set()
        self._thread.join()
        if self.proc.poll() is None:
            return {**self.seen, **process_tree(self.proc.pid)}
        # reaped: its pid may be another process's now, and its orphans have no parent link to it
        return {pid: start for pid, start in self.seen.items() if pid != self.proc.pid}


def _stop(tree: Mapping[int, str], grace: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM to the processes of `tree` still running; SIGKILL to what is left of them after `grace`
    seconds, or as soon as this wait is interrupted; `proc` (one of them, this process's child) reaped,
    and on return the killed ones gone (within `KILL_WAIT` seconds)."""
    try:
        _signal(tree, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc is not None:
                proc.poll()  # reaps it once it exits
            if not any(_running(pid, start) for pid, start in tree.items()):
                break
            time.sleep(0.1)
    finally:
        tree = {pid: start for pid, start in tree.items() if _running(pid, start)}
        try:  # and what they started meanwhile (a pid found anew keeps the start time found first)
            if tree:
                tree = {**process_tree(*tree), **tree}
        finally:  # killed even where that look is itself interrupted (a third Ctrl-C)
            _signal(tree, signal.SIGKILL)
            # a killed process takes a moment to exit (a GPU's memory is freed then): gone on return, or
            # named after KILL_WAIT seconds (one stuck in a device driver is not waited on for ever)
            deadline = time.monotonic() + KILL_WAIT
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
            # ("": a root /proc does not show, reaped above where it is `proc`)
            alive = [pid for pid, start in tree.items() if start and _running(pid, start)]
            while alive and time.monotonic() < deadline:
                time.sleep(0.02)
                alive = [pid for pid in alive if _running(pid, tree[pid])]
            if alive:
                log.warning("pid %s still there %.0f s after SIGKILL (in uninterruptible sleep: a device driver)",
                            ", ".join(map(str, sorted(alive))), KILL_WAIT)


def stop_unwatched(proc: subprocess.Popen, grace: float) -> None:
    """Stop `proc`, started but interrupted before its watch began, and its descendants as they are now."""
    _stop({proc.pid: ""}, grace, proc)


def stop_watched(watch: Watch, grace: float) -> None:
    """Stop the job's tree, recorded and present: its process, if still running, and what of the
    processes it started outlived it (a warning names them)."""
    try:
        tree = watch.close()
    except BaseException:  # a second interrupt while the tree is looked at: what was recorded is killed at once
        _stop(watch.seen, 0, watch.proc)
        raise
    if watch.proc.poll() is not None:
        left = sorted(pid for pid, start in tree.items() if _running(pid, start))
        if left:
            log.warning("%s exited (code %s) leaving %d of its processes running (pid %s): stopping them",
                        Path(str(watch.proc.args[0])).name, watch.proc.returncode, len(left),
                        ", ".join(map(str, left)))
    _stop(tree, grace, watch.proc)


@contextlib.contextmanager
def running(cmd: Sequence[str], env: Mapping[str, str] | None = None, grace: float = 60.0,
            interval: float | None = None) -> Iterator[subprocess.Popen]:
    """`cmd` running for the block's duration (a server), stopped with its descendants after it,
    those it left behind included."""
    proc = subprocess.Popen(list(cmd), env=env)
    try:
        watch = Watch(proc, WATCH_INTERVAL if interval is None else interval)
    except BaseException:  # interrupted before the watch began: the job, and what it started, stopped now
        stop_unwatched(proc, 0)
        raise
    try:
        yield proc
    finally:
        stop_watched(watch, grace)


def run(cmd: Sequence[str], env: Mapping[str, str] | None = None, grace: float = 30.0,
        interval: float | None = None) -> None:
    """`subprocess.run(cmd, check=True)`, with its descendants stopped too if this is interrupted, and
    those still running when it exits."""
    with running(cmd, env, grace, interval) as proc:
        code = proc.wait()
    if code:
        raise subprocess.CalledProcessError(code, list(cmd))
