"""Pieces of a user's that an installed package names under one of selfevo's entry-point groups, so that a
command finds them without a line of selfevo's changed (the package's pyproject.toml:
`[project.entry-points."selfevo.agents"]` `mine = "mypkg.agents:make"`; docs/extending.md):

- `selfevo.agents`: solver factories for `selfevo eval --agent NAME[:ARG]`;
- `selfevo.learners`: the learners of `selfevo evolve --learners NAME` (`evolve.Agents`);
- `selfevo.judges`: judge factories for `selfevo audit --judge NAME[:ARG]`;
- `selfevo.treatments`: a treatment's rules, for `--treatment NAME` (`loop.treatments`).
"""

from __future__ import annotations

import re
from importlib.metadata import EntryPoint, entry_points
from typing import Any

# a name that is one path component: a user's treatment names its runs' directories in grids, a user's judge
# its audit's directory
DIRECTORY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class ContractError(ValueError, TypeError):
    """A piece of a user's (agent, learner, judge, rule) answered outside its protocol, named by the check that
    met it. The commands print it as one line; any other exception inside such a piece keeps its traceback,
    which locates the bug. (A ValueError and a TypeError, as the checks raised before it existed.)"""


def installed(group: str) -> dict[str, EntryPoint]:
    """The names installed packages give under `group`, and what each points at."""
    return {ep.name: ep for ep in entry_points(group=group)}


def load(group: str, name: str, what: str) -> Any:
    """The object `name` points at under `group`; `what` names the kind of piece in errors ("agent", ...)."""
    eps = entry_points(group=group)
    # by package too: two pointing at one function are still two packages claiming the name
    same = {(ep.value, getattr(ep.dist, "name", "?")): ep for ep in eps if ep.name == name}
    if not same:
        known = ", ".join(sorted({ep.name for ep in eps})) or "none installed"
        raise ValueError(f"{what} '{name}': no installed package names it under the {group} entry points "
                         f"(known: {known})")
    if len(same) > 1:  # which one `entry_points` lists last is no choice of the user's
        raise ValueError(f"{what} '{name}': named by several installed packages under the {group} entry points ("
                         + ", ".join(f"{value} in {dist}" for value, dist in sorted(same))
                         + "); uninstall all but one")
    ep = next(iter(same.values()))
    try:
        return ep.load()
    except Exception as e:  # the package's own import error: named, with where it came from
        raise ValueError(f"{what} '{name}': loading {ep.value} (entry point {group}) failed: "
                         f"{type(e).__name__}: {e}") from e


def qualified_name(obj: Any) -> str:
    """How a run records a piece of a user's: its module and qualified name."""
    return f"{getattr(obj, '__module__', type(obj).__module__)}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def recorded_name(obj: Any, what: str, signature: str) -> str:
    """`qualified_name(obj)` of a function defined at a module's top level and found there under that name: a
    run records it by the name, and a resume finds it again by it. A partial, an instance, a lambda or a
    wrapper copying another's name has no name of its own (two would pass for one another), nor has a function of
    the script or notebook running (`__main__`: any other's function of that name would pass for it):
    ContractError."""
    import importlib
    import inspect

    if inspect.isfunction(obj) and obj.__module__ == "__main__":
        raise ContractError(f"{what} {obj.__qualname__}, a function of the script or notebook running (__main__), "
                            "which a run cannot name (another script's function of that name would pass for it): "
                            f"define it in a module of its own, imported from there {signature}")
    if inspect.isfunction(obj) and "<" not in obj.__qualname__:
        try:
            found = importlib.import_module(obj.__module__)
            for part in obj.__qualname__.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if found is obj:
            return qualified_name(obj)
    raise ContractError(f"{what} an object of type {type(obj).__name__} ({qualified_name(obj)}), not a function "
                        f"defined at a module's top level under its own name {signature}")
