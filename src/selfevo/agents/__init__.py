"""Agents: the Proposer/Solver protocols (`base`) and their backends, loaded by spec.

A spec is `PREFIX` or `PREFIX:ARG` (e.g. `retrieval-baseline`, `remote:MODEL@URL`, later
`sim:...`, `lm:...`).
Factories import their backend lazily, so asking for the baseline never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from selfevo._plugins import installed, load
from selfevo.agents.base import Solver, Trajectory

AgentFactory = Callable[..., Solver]  # factory(arg: str, **context) -> Solver


def _retrieval_baseline(arg: str, **context: Any) -> Solver:
    from selfevo.agents.baseline import RetrievalBaseline

    if arg:
        raise ValueError(f"agent 'retrieval-baseline' takes no argument, got '{arg}'")
    return RetrievalBaseline()


def _remote(arg: str, **context: Any) -> Solver:
    """`remote:MODEL@URL`: an OpenAI-compatible chat endpoint (inference only). The endpoint is
    probed once here, so a wrong URL or key fails before any indexing or evaluation."""
    from selfevo.agents.chat_client import EndpointError
    from selfevo.agents.remote import RemoteSolver, parse_remote_spec

    model, url = parse_remote_spec(arg)
    solver = None
    try:
        solver = RemoteSolver(url, model)  # refuses a malformed URL or API key
        solver.check()
    except EndpointError as e:
        if solver is not None:
            solver.close()
        raise ValueError(f"agent 'remote:{arg}': {e}") from None
    return solver


def _lm(arg: str, **context: Any) -> Solver:
    """`lm:MODEL[@ADAPTER]`: a language model answering in the Search-R1 protocol, untrained (the
    base model) or with a LoRA adapter saved by a run (a `.safetensors` file from its
    checkpoints/tensors). `context` may carry `lm_options` (LMConfig fields, e.g. device), and
    `workers` (N >= 1: answer on N Ray actors, each searching `retriever_url` or `corpus`)."""
    from selfevo.agents.lm.agents import LMSolver
    from selfevo.agents.lm.config import LMConfig
    from selfevo.agents.lm.policy import LMPolicy

    model, _, adapter = arg.partition("@")
    if not model:
        raise ValueError("agent 'lm' needs a model: lm:smollm2-135m, lm:/path/to/model or lm:org/name")
    cfg = LMConfig(model=model, **(context.get("lm_options") or {}))
    if adapter and not Path(adapter).is_file():  # before the model loads (seconds; a 4B model, minutes)
        if Path(adapter).is_dir():
            raise ValueError(f"{adapter}: a directory; name the policy file in it (a run's are "
                             "checkpoints/tensors/main-<hash>.safetensors)")
        raise ValueError(f"{adapter}: cannot read the policy file (no such file)")
    workers = int(context.get("workers") or 0)
    if workers:  # `selfevo eval --workers N`: the rollouts run on N Ray actors (agents/lm/workers.py)
        from selfevo.agents.lm.workers import RolloutWorkers

        return RolloutWorkers(cfg, workers, {"evaluated": adapter} if adapter else None,
                              policy_name="evaluated" if adapter else None, name=f"lm:{arg}",
                              retriever_url=context.get("retriever_url"), corpus=context.get("corpus"))
    policy = LMPolicy(cfg)
    if not adapter:
        return LMSolver(policy, f"lm:{model}", policy_name=None, frozen=True)
    return LMSolver.from_file(policy, f"lm:{arg}", adapter)


_REGISTRY: dict[str, AgentFactory] = {"retrieval-baseline": _retrieval_baseline, "remote": _remote, "lm": _lm}
# how each built-in spec is written, for the --agent help and the unknown-spec error
SPEC_FORMS = {"retrieval-baseline": "retrieval-baseline", "lm": "lm:MODEL[@POLICY.safetensors]",
              "remote": "remote:MODEL@URL"}


def register_agent(prefix: str, factory: AgentFactory) -> None:
    """Make `prefix[:arg]` specs load through `factory(arg, **context)`."""
    if not prefix or ":" in prefix or prefix != prefix.strip():
        # load_agent splits a spec at its first ':' and strips it: such a prefix could never be loaded
        raise ValueError(f"agent prefix {prefix!r}: must be non-empty, without ':' or surrounding whitespace")
    if prefix in _REGISTRY:
        raise ValueError(f"agent prefix '{prefix}' is already registered")
    _REGISTRY[prefix] = factory


def known_agents() -> list[str]:
    return sorted({*_REGISTRY, *installed(ENTRY_POINTS)})


# where an installed package of a user's names its agent factories (its pyproject.toml:
# [project.entry-points."selfevo.agents"] PREFIX = "module:factory"), so `selfevo eval --agent PREFIX:ARG`
# finds them without a line of selfevo's changed
ENTRY_POINTS = "selfevo.agents"


def load_agent(spec: str, **context: Any) -> Solver:
    """Build the solver a spec names: a built-in one, one `register_agent` registered, or one an installed
    package names under the `selfevo.agents` entry points. `context` carries what a backend may need (corpus
    path, retriever_url, lm_options, workers); each factory takes what it uses and ignores the rest."""
    prefix, _, arg = spec.strip().partition(":")
    factory = _REGISTRY.get(prefix)
    if factory is None and prefix in installed(ENTRY_POINTS):
        factory = load(ENTRY_POINTS, prefix, "agent")
        register_agent(prefix, factory)
    if factory is None:
        forms = (SPEC_FORMS.get(p, f"{p}[:ARG]") for p in known_agents())
        raise ValueError(f"unknown agent spec '{spec}'; known: {', '.join(forms)}")
    solver = factory(arg, **context)
    if not callable(getattr(solver, "answer", None)):  # a factory of a user's that returned nothing
        raise ValueError(f"agent '{prefix}': its factory returned {type(solver).__name__}, not a solver (an object "
                         "with answer(questions, tool, ...))")
    return solver


def agent_files(spec: str) -> dict | None:
    """What a built-in spec's agent reads from disk, by content: an `lm:` agent's model (`model_identity`: its
    files' names, sizes and times) and policy file (sha256). A stopped evaluation goes on only while these
    are the same; None for an agent that reads no files of its own."""
    prefix, _, arg = spec.strip().partition(":")
    if prefix != "lm":
        return None
    from selfevo._io import file_sha256
    from selfevo.agents.lm.model import model_identity
    from selfevo.agents.lm.policy import resolve_model

    model, _, adapter = arg.partition("@")
    return {"model": model_identity(resolve_model(model)), "policy": file_sha256(adapter) if adapter else None}


__all__ = ["Solver", "Trajectory", "agent_files", "known_agents", "load_agent", "register_agent"]
