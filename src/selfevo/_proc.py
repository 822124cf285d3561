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

The job stays in this process's group and session, so what a terminal sends (Ctrl-C, Ctrl-Z,
Ctrl-\\, a hang-up) reaches it as before. Without /proc (macOS) only the direct child is stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a process from /proc; None if there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], fields[19]


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


def stop_tree(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to `proc` and its descendants; SIGKILL to what is left of them after `grace` seconds,
    or as soon as this wait is interrupted; `proc` reaped."""
    tree = process_tree(proc.pid)
    try:
        _signal(tree, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reaps it once it exits
            if not any(_running(pid, start) for pid, start in tree.items()):
                break
            time.sleep(0.1)
    finally:
        alive = {pid: start for pid, start in tree.items() if _running(pid, start)}
        # and what they started meanwhile (a pid found anew keeps the start time found first)
        tree = {**process_tree(*alive), **alive} if alive else {}
        _signal(tree, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def running(cmd: Sequence[str], env: Mapping[str, str] | None = None,
            grace: float = 60.0) -> Iterator[subprocess.Popen]:
    """`cmd` running for the block's duration (a server), stopped with its descendants after it."""
    proc = subprocess.Popen(list(cmd), env=env)
    try:
        yield proc
    finally:
        stop_tree(proc, grace)


def run(cmd: Sequence[str], env: Mapping[str, str] | None = None, grace: float = 30.0) -> None:
    """`subprocess.run(cmd, check=True)`, with its descendants stopped too if this is interrupted."""
    proc = subprocess.Popen(list(cmd), env=env)
    try:
        code = proc.wait()
    except BaseException:
        stop_tree(proc, grace)
        raise
    if code:
        raise subprocess.CalledProcessError(code, list(cmd))
