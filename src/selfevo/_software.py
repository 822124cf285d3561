"""The software a run is made with: the interpreter, the platform and the versions of the packages
its numbers depend on. Same seed and config give byte-identical records only under the same
software (numpy's sampling, bm25s's scoring, torch's kernels), so a run records it, and a resume or a
report under other software can name the difference instead of leaving it to be guessed."""

from __future__ import annotations

import functools
import hashlib
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from selfevo import __version__

# the sim's numbers depend on the first two; the language-model backend, the engines and dense retrieval on
# the rest (a package not installed is left out)
PACKAGES = ("numpy", "bm25s", "torch", "transformers", "peft", "accelerate", "trl", "vllm", "verl",
            "faiss-cpu", "faiss-gpu", "sentence-transformers", "ray")


class SoftwareChanged(UserWarning):
    """A run resumed under other software (Python, platform, package versions) than it was made with."""


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """The first 12 hex digits of the sha256 of selfevo's own source files (their paths and bytes): the
    package's version has not moved while its code has, and a resume under other code is other software."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def software() -> dict[str, str]:
    """{"python", "platform", "selfevo", "selfevo_source" (`source_digest`), and each installed package
    of PACKAGES: its version}."""
    out = {"python": platform.python_version(), "platform": f"{platform.system()} {platform.machine()}",
           "selfevo": __version__, "selfevo_source": source_digest()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def software_changes(was: dict, now: dict) -> list[str]:
    """What differs between two `software()` records, one "name was → now" per entry ("none" for a
    package on one side only), in name order."""
    return [f"{k} {was.get(k, 'none')} → {now.get(k, 'none')}"
            for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]


def software_tally(manifests: list[dict]) -> dict:
    """What software a set of runs was made with, from their manifests:
    {"versions": {name: {version: runs}}, "unrecorded": runs made before runs recorded it,
    "resumed_under_other": runs resumed under other software than they were made with}.
    A package missing from some runs' records counts them under version "none"."""
    records = [m["software"] for m in manifests if isinstance(m.get("software"), dict)]
    names = list(dict.fromkeys(k for r in records for k in r))  # software()'s order: python first
    versions = {k: {} for k in names}
    for r in records:
        for k in names:
            v = str(r.get(k, "none"))
            versions[k][v] = versions[k].get(v, 0) + 1
    return {"versions": versions, "unrecorded": len(manifests) - len(records),
            "resumed_under_other": sum(1 for m in manifests if m.get("software_resumed"))}


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def software_text(tally: dict) -> str:
    """One line for a report: what every run shared, then what differs between them (by run count)."""
    versions = tally.get("versions", {})
    shared = [f"{k} {next(iter(v))}" for k, v in versions.items() if len(v) == 1]
    differ = [f"{k} " + ", ".join(f"{ver} ({_runs(n)})" for ver, n in sorted(v.items()))
              for k, v in versions.items() if len(v) > 1]
    parts = [f"every run: {', '.join(shared)}"] if shared else []
    if differ:
        parts.append(f"the runs differ in {'; '.join(differ)}")
    if n := tally.get("resumed_under_other"):
        parts.append(f"{_runs(n)} resumed under other software than made with (manifest.json: software_resumed)")
    if n := tally.get("unrecorded"):
        parts.append(f"{_runs(n)} made before runs recorded it")
    return "; ".join(parts) or "not recorded"
