"""Pieces of a user's that an installed package names under one of selfevo's entry-point groups, so that a
command finds them without a line of selfevo's changed (the package's pyproject.toml:
`[project.entry-points."selfevo.agents"]` `mine = "mypkg.agents:make"`; docs/extending.md):

- `selfevo.agents`: solver factories for `selfevo eval --agent NAME[:ARG]`;
- `selfevo.learners`: the learners of `selfevo evolve --learners NAME` (`evolve.Agents`);
- `selfevo.judges`: judge factories for `selfevo audit --judge NAME[:ARG]`.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any


def installed(group: str) -> dict[str, EntryPoint]:
    """The names installed packages give under `group`, and what each points at."""
    return {ep.name: ep for ep in entry_points(group=group)}


def load(group: str, name: str, what: str) -> Any:
    """The object `name` points at under `group`; `what` names the kind of piece in errors ("agent", ...)."""
    found = installed(group)
    if name not in found:
        known = ", ".join(sorted(found)) or "none installed"
        raise ValueError(f"{what} '{name}': no installed package names it under the {group} entry points "
                         f"(known: {known})")
    ep = found[name]
    try:
        return ep.load()
    except Exception as e:  # the package's own import error: named, with where it came from
        raise ValueError(f"{what} '{name}': loading {ep.value} (entry point {group}) failed: "
                         f"{type(e).__name__}: {e}") from e


def qualified_name(obj: Any) -> str:
    """How a run records a piece of a user's: its module and qualified name."""
    return f"{obj.__module__}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def top_level_function(obj: Any) -> bool:
    """A function defined at a module's top level: a run records it by its module and name, and a resume finds
    it again by them. A partial, an instance or a lambda has no name of its own (two would pass for one
    another)."""
    import inspect

    return inspect.isfunction(obj) and "<" not in obj.__qualname__


def name_of(group: str, qualname: str) -> str | None:
    """The installed name under `group` of the piece a run recorded as `qualname` (`qualified_name`), or None.
    An entry point that says where the piece is defined (`module:attr`) is matched without importing it; one
    that points at a re-export is loaded to read its qualified name."""
    found = installed(group)
    for name, ep in found.items():
        if f"{ep.module}.{ep.attr}" == qualname:
            return name
    for name, ep in found.items():
        try:
            if qualified_name(ep.load()) == qualname:
                return name
        except Exception:  # a broken package that is not the one asked for
            continue
    return None
