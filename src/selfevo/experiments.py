"""Grids of treatments x seeds x configs as independent jobs on an executor: local worker
processes, or Ray (`ray.init()` locally, or the cluster named by RAY_ADDRESS).

Every job is one `evolve` run into its own directory, fully determined by its config, so results
are identical whichever executor runs them. A failed job is reported with its error and the rest
still complete; rerunning a grid skips finished jobs and resumes interrupted ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from selfevo import _proc

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Job:
    name: str
    overrides: tuple[str, ...]  # `--set`-style config overrides, e.g. ("treatment=crossfit", "seed=0")
    out: str  # its run directory
    treatment: str | None = None  # the grid cell it runs (grid() sets both)
    seed: int | None = None


def grid(treatments: Sequence[str], seeds: Sequence[int], root: str | os.PathLike,
         common: Sequence[str] = ()) -> list[Job]:
    """One job a (treatment, seed), named `<treatment>-s<seed>` under `root`, each with the `common`
    overrides; those may not set what the grid sets per job (they were overridden silently)."""
    if isinstance(common, str):  # else each job's overrides are its characters
        raise TypeError(f"common: a list of KEY=VALUE strings, got one string ({common!r}): pass [{common!r}]")
    for o in common:
        key = o.split("=", 1)[0].strip()
        if key in ("treatment", "seed"):
            raise ValueError(f"common: {o!r} sets {key}, which the grid sets for each job (its {key}s)")
    root = Path(root)
    return [Job(f"{t}-s{s}", (*common, f"treatment={t}", f"seed={s}"), str(root / f"{t}-s{s}"), t, s)
            for t in treatments for s in seeds]


def run_job(job: Job) -> dict:
    """Run one job; never raises (a failure is a result)."""
    from selfevo.config import RunConfig, load_config
    from selfevo.evolve import check_made_by, check_world, evolve, user_pieces
    from selfevo.runs import RunDir

    run = RunDir(job.out)
    try:
        cfg = load_config(overrides=list(job.overrides), set_by="the job's overrides")
        if run.exists() and run.manifest().get("status") == "complete":
            # finished under this job's config, or its results would pass for this grid's
            run.check_config(cfg.to_json(), defaults=RunConfig().to_json())
            check_world(run, cfg)  # ... and on the world (directory) it names now, as a resume checks
            check_made_by(run, cfg, *user_pieces(cfg)[1:])  # ... by the functions its names point at now
            return {"job": job.name, "status": "skipped", "run": job.out}
        evolve(cfg, job.out, resume=run.exists(), progress=False)
        return {"job": job.name, "status": "ok", "run": job.out}
    except Exception as e:  # noqa: BLE001 - one job's failure must not stop the grid
        return {"job": job.name, "status": "failed", "run": job.out, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()}


def run_grid(jobs: Sequence[Job], executor: str = "local", workers: int | None = None,
             on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every job; results in job order. `on_done` is called as each finishes (progress)."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    # two jobs on one directory would write it at the same time; results are keyed by name
    for what, seen in (("name", [j.name for j in jobs]), ("run directory", [str(Path(j.out).resolve()) for j in jobs])):
        dup = next((k for k in seen if seen.count(k) > 1), None)
        if dup is not None:
            raise ValueError(f"jobs: two jobs share the {what} {dup!r}")
    results: dict[str, dict] = {}

    def done(res: dict) -> None:
        results[res["job"]] = res
        if on_done:
            on_done(res)

    if executor == "ray":
        try:
            import ray
        except ImportError:
            raise ValueError("executor ray: Ray is not installed (pip install 'selfevo[ray]')") from None

        from selfevo.config import absolute_overrides

        started = not ray.is_initialized()
        if started:
            from selfevo.agents.lm.workers import start_ray

            start_ray()  # a local Ray only with token auth; the command's SIGTERM handling kept
        pending = {}
        try:
            remote = ray.remote(run_job)
            have = ray.cluster_resources().get("GPU", 0) if jobs else 0  # (asked once; no job, no question)
            gpus = [_job_gpus(job, have) for job in jobs]  # all checked before any job starts
            # a worker's working directory is not the driver's (on a cluster, not even its machine): it gets
            # the run directory as an absolute path, and the result names it as the job does (as locally);
            # each task is kept as it is submitted, to be cancelled if this is interrupted before the last
            for job, g in zip(jobs, gpus):
                pending[remote.options(num_gpus=g).remote(
                    replace(job, out=str(Path(job.out).resolve()), overrides=absolute_overrides(job.overrides)))] = job
            # installed after ray.init, whose driver handler makes SIGTERM exit 1 (a failed job's code)
            with terminate_raises():
                while pending:
                    ready, _ = ray.wait(list(pending), num_returns=1)
                    for ref in ready:
                        job = pending.pop(ref)
                        try:
                            done({**ray.get(ref), "run": job.out})
                        except Exception as e:  # noqa: BLE001 - run_job never raises: its worker died
                            done(_died(job, e))
        except BaseException:  # Ctrl-C, SIGTERM: the jobs stop with the grid, as the local workers do
            for ref in pending:  # (a rerun resumes their runs)
                ray.cancel(ref, force=True)
            raise
        finally:
            if started:  # the Ray this grid started, with its idle workers' memory, is not kept after it
                ray.shutdown()
    else:
        # never more processes than jobs: the rest would only be forked to sit idle
        workers = min(workers or os.cpu_count() or 1, len(jobs)) or 1
        if workers == 1:
            for job in jobs:
                done(run_job(job))
        else:
            _job_processes(jobs, workers, done)
    return [results[j.name] for j in jobs]


def _job_gpus(job: Job, cluster_gpus: float) -> int:
    """The GPUs a Ray task of `job` asks for: one for a language-model run on cuda (or on auto where the
    cluster has a GPU), else none. A task that asks for none sees every GPU of its node (Ray 2.60 no
    longer hides them) and would start on cuda:0 beside the others, while GPUs sit idle."""
    from selfevo.agents.lm.workers import task_gpus
    from selfevo.config import ConfigError, load_config

    try:
        cfg = load_config(overrides=list(job.overrides))
    except (ConfigError, ValueError):  # the job fails in its worker and says why there
        return 0
    device = cfg.lm.device if cfg.backend == "lm" else "cpu"
    if device.startswith("cuda:") and device != "cuda:0":  # Ray shows a task its one GPU as cuda:0
        raise ValueError(f"job {job.name}: lm.device {device} on Ray: a task sees only the GPU Ray gives it, as "
                         "cuda:0; set lm.device = \"cuda\" (Ray picks the GPU)")
    want = task_gpus(device, cluster_gpus)
    if want > cluster_gpus:  # Ray would queue the task and wait for a GPU forever
        raise ValueError(f"job {job.name}: lm.device {device} needs a GPU; the Ray cluster has none "
                         "(set lm.device = \"cpu\", or join a cluster with GPUs: RAY_ADDRESS)")
    return want


def _job_processes(jobs: Sequence[Job], workers: int, done: Callable[[dict], None],
                   grace: float = 10.0) -> None:
    """Each job in a process of its own, at most `workers` at a time: a job whose process dies (the OOM
    killer, kill -9) fails alone, where a process pool, broken by one death, failed every job not yet
    finished, those never started included. Like `worker_pool`, the processes die with this one and
    are killed on Ctrl-C or SIGTERM (a rerun of the grid resumes their runs). Not daemonic: a job may
    start processes of its own (vLLM does): each job's tree is watched as `_proc.running` watches a
    command's, and what of it outlives the job's process is stopped, with a warning naming it. A job's
    result counts when it is sent: a process slow to exit after it (a thread of the job's left running)
    holds up nothing, and is stopped `grace` seconds after the last job's result if it is still there."""
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    # procs: each job process started and not yet stopped -> its watch (None until the watch begins: an
    # interruption then, on a loaded machine a /proc scan's while, left the process out of the stop below, and
    # the interpreter's exit joined it: the grid waited for the whole job); running: a result pipe's read end ->
    # (its process, job); the processes of procs not running sent their result and are still exiting
    queue, running, finished = list(jobs), {}, False
    procs: dict[_JobProcess, _proc.Watch | None] = {}
    with terminate_raises():
        try:
            while queue or running:
                while queue and len(running) < workers:
                    job = queue.pop(0)
                    recv, send = ctx.Pipe(duplex=False)
                    proc = _JobProcess(ctx.Process(target=_job_process, args=(os.getpid(), job, send)), job)
                    procs[proc] = None
                    proc.process.start()
                    send.close()  # this end is the child's: its death closes the pipe (EOF), not a hang
                    running[recv] = (proc, job)
                    procs[proc] = _proc.Watch(proc, _proc.WATCH_INTERVAL)
                # a job's result, or its process's end, looked for every second: one that died without sending
                # its result may have forked a process that holds the pipe (and its sentinel) open, and no end
                # of file would come
                ready = set(multiprocessing.connection.wait(list(running), timeout=1.0))
                for recv in [r for r, (p, _) in running.items() if r in ready or p.poll() is not None]:
                    proc, job = running.pop(recv)
                    try:
                        res = recv.recv() if recv.poll() else None
                    except (EOFError, OSError):  # died before it sent its result, or while sending it
                        res = None
                    recv.close()
                    with contextlib.suppress(subprocess.TimeoutExpired):  # it exits now, as a rule: then no
                        proc.wait(None if res is None else 1.0)  # more than `workers` live at once
                    if res is None:
                        res = _died(job, RuntimeError(f"exit code {proc.returncode}"))
                    done(res)
                # what an ended process started and left running is stopped (the warning names it)
                busy = {p for p, _ in running.values()}
                for proc in [p for p in procs if p not in busy and p.poll() is not None]:
                    _proc.stop_watched(procs[proc], 0)
                    del procs[proc]
            finished = True
        finally:  # each job's process and what it started (vLLM's engine processes, holding a GPU): at once
            # where this is interrupted (Ctrl-C, SIGTERM, an error), else `grace` seconds after the last result
            deadline = time.monotonic() + (grace if finished else 0)
            try:
                for proc in procs:
                    if proc.pid is not None:  # (None: interrupted in its start before the fork, or just after:
                        # then no parent waits on it at exit, and it dies with this process, `_pool_worker`)
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            proc.wait(max(0.0, deadline - time.monotonic()))
            finally:  # a Ctrl-C in that wait stops them at once; each is stopped, however many interrupts
                # land in the others' stops (a second SIGTERM had ended the loop, leaving the jobs after it
                # running, and the interpreter's exit waiting on them)
                with contextlib.ExitStack() as stops:
                    for recv in running:
                        stops.callback(recv.close)
                    for proc, watch in procs.items():
                        if watch is not None:
                            stops.callback(_proc.stop_watched, watch, 0)
                        elif proc.pid is not None:
                            stops.callback(_proc.stop_unwatched, proc, 0)


class _JobProcess:
    """A grid's job process as `_proc` watches and stops a command's (the Popen methods it calls)."""

    def __init__(self, process: multiprocessing.Process, job: Job):
        self.process, self.args = process, [f"job {job.name}"]

    @property
    def pid(self) -> int | None:
        return self.process.pid  # None until it has started

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        self.process.is_alive()  # reaps it once it has ended
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode


def _job_process(parent: int, job: Job, send) -> None:
    _pool_worker(parent, None, ())  # SIGTERM's default action, and death with the grid's process
    send.send(run_job(job))


@contextlib.contextmanager
def worker_pool(workers: int, initializer: Callable | None = None, initargs: tuple = ()):
    """A process pool that does not outlive this process: SIGTERM raises here (`terminate_raises`),
    and on any exception out of the block (Ctrl-C, SIGTERM, an error) the workers are killed now, not
    after the pool has run every queued job (an orphan would go on writing run directories a rerun
    resumes, and hold their locks); the pool, broken, fails the queued jobs. A run killed mid-way
    resumes on the rerun, as after kill -9, and a kill -9 of this process takes the workers with it
    (`_pool_worker`). `initializer(*initargs)` then runs in each worker."""
    # fork where it is the platform's own (Linux): works from any __main__ (stdin, notebooks), and
    # the workers are this process's children (_pool_worker checks that)
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_pool_worker,
                               initargs=(os.getpid(), initializer, initargs))
    with terminate_raises(), pool:  # the workers are forked inside it, at the first submit
        try:
            yield pool
        except BaseException:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.kill()
            raise


def _pool_worker(parent: int, initializer: Callable | None, initargs: tuple) -> None:
    """Every pool worker's start: SIGTERM's default action (it is forked inside terminate_raises,
    whose handler would raise in the middle of a job), and death with `parent`, the process that
    made the pool."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        # kill -9 or the OOM killer gives the parent no chance to stop its workers: the kernel
        # does, with SIGKILL when the parent exits (the forking thread, strictly: pools here are
        # made and submitted to from the main thread). Elsewhere an orphan finishes its jobs.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took: no signal will come
            os._exit(1)
    if initializer is not None:
        initializer(*initargs)


@contextlib.contextmanager
def terminate_raises():
    """SIGTERM raises SystemExit(143) here (in the main thread), so the block's `finally` blocks run:
    a pool's workers, a training subprocess, a served model stop with this process instead of
    outliving it; elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    terminated = False

    def handler(signum, frame):
        nonlocal terminated
        terminated = True
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except SystemExit:
        if terminated:  # SIGTERM's code, where a library re-raised the exit as its own (Ray's wait: 1)
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _died(job: Job, e: BaseException) -> dict:
    return {"job": job.name, "status": "failed", "run": job.out,
            "error": f"worker process died ({type(e).__name__}: {e}); rerun the grid to resume it"}
