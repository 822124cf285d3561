"""Subprocesses that stop with this process, children included.

`subprocess.run` kills only its direct child when it is interrupted. A training job's child is a
launcher (`accelerate launch`, `torchrun`, `bash` running verl's script) whose own children do the
training: killed alone, it leaves them orphaned, still writing into the run a resume is about to
take. So each job runs as the leader of its own process group, and stopping it (Ctrl-C, SIGTERM raised
by `experiments.terminate_raises`, an error) signals the whole group: SIGTERM, then SIGKILL after a
grace period, or at once if the stop is itself interrupted (a second Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to `proc`'s process group; SIGKILL to what is left of it after `grace` seconds, or
    as soon as this wait is interrupted; the leader reaped."""
    try:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is empty: all of it has exited
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def process_group(cmd: Sequence[str], env: Mapping[str, str] | None = None,
                  grace: float = 60.0) -> Iterator[subprocess.Popen]:
    """`cmd` running, as the leader of its own process group, for the block's duration (a server)."""
    proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc, grace)


def run_group(cmd: Sequence[str], env: Mapping[str, str] | None = None, grace: float = 30.0) -> None:
    """`subprocess.run(cmd, check=True)`, with its whole process group stopped if this is interrupted."""
    proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)
    try:
        code = proc.wait()
    except BaseException:
        stop_group(proc, grace)
        raise
    if code:
        raise subprocess.CalledProcessError(code, list(cmd))
