"""Rollout workers: Search-R1 rollouts of one LM solver spread over Ray actors (inference only).

Each actor holds its own `LMPolicy` (the base model, plus any adapters given as saved policy
files) and its own `SearchTool`, and answers a contiguous shard of the questions with exactly
`LMSolver.answer` -- the one rollout driver, the same protocol, the same tool budget. The shards
come back in order, so the result lists line up with the questions.

Greedy decoding is deterministic, so the answers are those of a single-process `LMSolver` (up to
the floating-point effects of a different batch composition: each worker pads its own batches).
Sampled rollouts are reproducible for a given seed and number of workers: shard k samples with
`derive_seed(seed, "shard", k)`.

The search tool cannot travel to the actors (an index may be gigabytes), so each actor makes its
own retriever over the same documents: a `RetrieverClient` on the same `/retrieve` server when the
caller's tool uses one (or `retriever_url` is given); else the caller's index directory, opened
again (any kind; its files are memory-mapped, so the actors on one machine share their pages),
when the caller's index was loaded from or saved to one; else a BM25 index built over `corpus`,
checked against the caller's BM25 index. A dense or hybrid index held only in memory must be saved
(`selfevo index build`) or served (`selfevo serve-retriever`).

    workers = RolloutWorkers(LMConfig(model="smollm2-135m"), 4, corpus="wiki18-mini.jsonl")
    trajectories = workers.answer(questions, tool)   # the Solver protocol
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from selfevo.agents.base import Trajectory
from selfevo.agents.lm.config import LMConfig
from selfevo.loop.schedule import derive_seed
from selfevo.records import Document
from selfevo.search.tool import SearchTool


def shard_bounds(n_items: int, n_shards: int) -> list[tuple[int, int]]:
    """Contiguous `[start, end)` ranges splitting `n_items` into at most `n_shards` non-empty
    shards whose sizes differ by at most one (the first ones take the remainder)."""
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    n = min(n_shards, n_items)
    bounds, start = [], 0
    for k in range(n):
        size = n_items // n + (1 if k < n_items % n else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def check_local_ray_auth(address: str | None) -> None:
    """Refuse to let `ray.init(address)` start a Ray instance here without token authentication. A
    local Ray's GCS, raylets and workers listen on every network interface (no setting keeps them all
    on loopback); Ray's token authentication is what stops others on the network from running code in
    it, and Ray turns it on for a local instance (from 2.59) unless RAY_AUTH_MODE says otherwise. An
    address naming a cluster is left alone: securing it is its owner's business."""
    if address and address != "local":
        return
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":  # Ray reads any other value as disabled
        raise ValueError(f"workers: RAY_AUTH_MODE={mode!r} would start a local Ray without token authentication, "
                         "reachable from the network; unset RAY_AUTH_MODE (or set it to token), or join a "
                         "cluster of your own with RAY_ADDRESS")


def check_ray_address(address: str | None, timeout: float = 5.0) -> None:
    """A cluster address that nothing answers at is said now: `ray.init` retries it for about 14 minutes
    (20 tries of some 40 s each) before its own error. "auto", a bad form and the like are left to Ray,
    which says so at once."""
    import socket

    host_port = (address or "").strip().removeprefix("ray://").rstrip("/")
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ValueError(f"RAY_ADDRESS={address}: nothing answers at {host_port} ({e.strerror or e}); start the "
                         "cluster's head there (`ray start --head`), or unset RAY_ADDRESS for a local Ray") from None


def task_gpus(device: str, cluster_gpus: float, tasks: int = 1) -> int:
    """The GPUs a Ray task running a model on `device` asks for: one on cuda, or on auto where the
    cluster has one for each of `tasks`; else none."""
    return 1 if device.startswith("cuda") or (device == "auto" and cluster_gpus >= tasks) else 0


class WorkerDied(RuntimeError):
    """A rollout worker (a Ray actor) died: its process was killed, ran out of memory, or its node left."""


def start_ray() -> None:
    """`ray.init` at RAY_ADDRESS (a local instance if unset, `check_local_ray_auth`), keeping the
    command's own SIGTERM handling: Ray's driver installs a handler that exits 15 (the command's, put
    back after the call, stops the work with its clean-up and says how to go on), and a SIGTERM during
    the call, which that handler turns into exit 15, is the command's exit 143. (A SIGTERM that reaches
    Ray's C++ code while it starts aborts the process: nothing in Python sees it.)"""
    import signal
    import threading

    import ray

    address = os.environ.get("RAY_ADDRESS")
    check_local_ray_auth(address)
    check_ray_address(address)
    before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        ray.shutdown()  # what it started, stopped with the command
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        if before is not None:  # None: not the main thread, or a handler not set from Python
            signal.signal(signal.SIGTERM, before)


class _RolloutWorker:
    """One actor: a policy for inference and one search tool per retriever source."""

    def __init__(self, cfg: LMConfig, adapter_refs: Mapping[str, str]):
        from selfevo.agents.lm.policy import LMPolicy

        self.policy = LMPolicy(cfg)
        for name, path in adapter_refs.items():
            self.policy.load_file(name, path)
        self._retrievers: dict[tuple, Any] = {}

    def ready(self) -> bool:
        return True

    def _retriever(self, source: tuple):
        if source not in self._retrievers:
            kind, where = source[:2]
            if kind == "url":
                from selfevo.search.client import RetrieverClient

                self._retrievers[source] = RetrieverClient(where)
            elif kind == "index":
                from selfevo.search.index import DenseOptions, open_index

                _, _, sha, fusion = source
                self._retrievers[source] = open_index(where, expected_corpus_sha256=sha,
                                                      options=DenseOptions(**dict(fusion)))
            else:
                from selfevo.search.bm25 import BM25Index

                self._retrievers[source] = BM25Index.from_corpus_file(where)
        return self._retrievers[source]

    def answer(self, source: tuple, topk: int, max_calls: int, policy_name: str | None,
               questions: list[str], greedy: bool, n: int, seed: int | None,
               contexts: list[Document] | None) -> list[list[Trajectory]]:
        from selfevo.agents.lm.agents import LMSolver

        tool = SearchTool(self._retriever(source), topk=topk, max_calls=max_calls)
        solver = LMSolver(self.policy, "worker", policy_name=policy_name, frozen=True)
        return solver.answer(questions, tool, greedy=greedy, n=n, seed=seed, contexts=contexts)


class RolloutWorkers:
    """A `Solver` whose rollouts run on `n_workers` Ray actors.

    `adapter_refs` maps policy names to saved policy files (`LMPolicy.save` output, a run's
    checkpoints/tensors/*.safetensors) that every actor loads; `policy_name` picks the policy that
    answers (None: the base model). Ray is started locally (or joins RAY_ADDRESS) if it is not
    running. Each actor takes one CPU, and one GPU when `lm.device` is cuda (or auto and the
    cluster has a GPU per worker); a cluster too small for all of them is an error, not a wait."""

    def __init__(self, cfg: LMConfig, n_workers: int, adapter_refs: Mapping[str, str | os.PathLike] | None = None,
                 *, policy_name: str | None = None, name: str | None = None,
                 retriever_url: str | None = None, corpus: str | os.PathLike | None = None):
        import ray

        if n_workers < 1:
            raise ValueError(f"workers: must be >= 1, got {n_workers}")
        refs = {k: str(v) for k, v in (adapter_refs or {}).items()}
        if policy_name is not None and policy_name not in refs:
            raise ValueError(f"policy {policy_name!r} is not among the adapters given ({', '.join(refs) or 'none'})")
        for path in refs.values():
            if not os.path.isfile(path):
                raise ValueError(f"{path}: no such policy file")
        self.cfg, self.policy_name = cfg, policy_name
        self.name = name or f"lm:{cfg.model}"
        self.retriever_url = retriever_url
        self.corpus = None if corpus is None else str(corpus)
        self._corpus_sha: str | None = None
        if not ray.is_initialized():
            start_ray()
        have = ray.cluster_resources()
        gpus = task_gpus(cfg.device, have.get("GPU", 0), n_workers)
        if have.get("CPU", 0) < n_workers or have.get("GPU", 0) < gpus * n_workers:
            # Ray would queue the actors that do not fit and wait for them forever
            need = f"{n_workers} CPUs" + (f" and {n_workers} GPUs" if gpus else "")
            raise ValueError(f"workers: {n_workers} rollout workers need {need}; the Ray cluster has "
                             f"{have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs")
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(_RolloutWorker)
        self._actors = [actor.remote(cfg, refs) for _ in range(n_workers)]
        # wait for the models here, so a bad model or adapter fails now, not at the first question
        try:
            self._get([a.ready.remote() for a in self._actors])
        except BaseException:
            self.close()
            raise

    @property
    def n_workers(self) -> int:
        return len(self._actors)

    @staticmethod
    def _get(refs):
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:  # re-raise the worker's own error (ValueError, ...)
            raise e.as_instanceof_cause() from None
        except ray.exceptions.RayActorError as e:
            raise WorkerDied(f"a rollout worker died: {e}") from None

    def _source(self, tool: SearchTool) -> tuple:
        """Where the actors search: the same documents the caller's `tool` searches."""
        from selfevo._io import file_sha256
        from selfevo.search.bm25 import BM25Index
        from selfevo.search.client import RetrieverClient
        from selfevo.search.index import saved_dir

        if isinstance(tool.retriever, RetrieverClient):
            return ("url", tool.retriever.url)
        if self.retriever_url:
            return ("url", self.retriever_url.rstrip("/").removesuffix("/retrieve"))
        home = saved_dir(tool.retriever)
        if home is not None:  # the hybrid's fusion settings may differ from its manifest's
            fusion = tuple((k, getattr(tool.retriever, k)) for k in ("rrf_k", "depth") if hasattr(tool.retriever, k))
            return ("index", str(home), tool.retriever.corpus_sha256, fusion)
        if self.corpus is None:
            raise ValueError("rollout workers need a retriever URL, a saved index or a corpus file to build their "
                             "search tool")
        if not isinstance(tool.retriever, BM25Index):
            raise ValueError(f"rollout workers rebuild a BM25 index from the corpus, but this tool searches a "
                             f"{type(tool.retriever).__name__} held in memory: save it (selfevo index build) or "
                             "serve it (selfevo serve-retriever) and give its URL")
        if self._corpus_sha is None:
            self._corpus_sha = file_sha256(self.corpus)
        if tool.retriever.corpus_sha256 != self._corpus_sha:
            raise ValueError(f"rollout workers: {self.corpus} is not the corpus the tool's BM25 index was built from")
        return ("corpus", self.corpus)

    def answer(self, questions: Sequence[str], tool: SearchTool, *, greedy: bool = True, n: int = 1,
               seed: int | None = None, contexts: Sequence[Document] | None = None) -> list[list[Trajectory]]:
        if contexts is not None and len(contexts) != len(questions):
            raise ValueError("one context per question")
        if not questions:
            return []
        source = self._source(tool)
        refs = []
        for k, (a, b) in enumerate(shard_bounds(len(questions), self.n_workers)):
            shard_seed = None if greedy else derive_seed(0 if seed is None else seed, "shard", k)
            refs.append(self._actors[k].answer.remote(
                source, tool.topk, tool.max_calls, self.policy_name, list(questions[a:b]), greedy, n, shard_seed,
                None if contexts is None else list(contexts[a:b])))
        return [trajs for part in self._get(refs) for trajs in part]

    def close(self) -> None:
        import ray

        for a in self._actors:
            ray.kill(a)
        self._actors = []

    def __enter__(self) -> RolloutWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
