"""Which lines of selfevo the test suite runs: the whole suite (CI's `python -m pytest`) under coverage.py.

    pip install 'coverage>=7.10'   # not a dependency of selfevo: only this script uses it
    python benchmarks/line_coverage.py [--out docs/reliability.md] [-- PYTEST ARGS]

Subprocesses (`selfevo` commands a test starts) and worker processes (the local executor's pool, the
replay's workers) are followed (coverage's `patch = subprocess`, `concurrency = multiprocessing, thread`);
Ray's worker processes are not (Ray starts them itself), so code that runs only in a Ray actor counts as
not run. Writes the "## Line coverage" section of docs/reliability.md: the total, and every file with a
line no test runs, with those lines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

from _common import REPO, machine_line, write_section

HEADING = "## Line coverage"


def line_ranges(lines: list[int]) -> str:
    """Sorted line numbers as ranges: [1, 2, 3, 7, 9, 10] -> '1-3, 7, 9-10'."""
    runs = [[n for _, n in run] for _, run in itertools.groupby(enumerate(sorted(lines)), lambda p: p[1] - p[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def package_rows(report: dict, package: Path) -> list[tuple[str, int, list[int]]]:
    """(path in the package, statements, lines not run) of each file of coverage's JSON report with a
    line not run, most lines not run first (ties by path)."""
    rows = []
    for path, entry in report["files"].items():
        missing = entry["missing_lines"]
        if missing:
            rel = Path(path).resolve().relative_to(package.resolve()).as_posix()
            rows.append((rel, entry["summary"]["num_statements"], missing))
    return sorted(rows, key=lambda r: (-len(r[2]), r[0]))


def rc_text(data_file: Path, package: Path, installed: Path) -> str:
    """coverage's settings: selfevo's lines, in this process and every subprocess and worker; the
    package imported from another place (an installed copy) is counted as the repository's."""
    aliases = "".join(f"\n    {p}" for p in dict.fromkeys([package, installed]))
    return ("[run]\nsource = selfevo\nparallel = true\nconcurrency = multiprocessing, thread\npatch = subprocess\n"
            f"data_file = {data_file}\n\n[paths]\nsource ={aliases}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "reliability.md")
    ap.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest (default: the whole suite)")
    args = ap.parse_args()
    try:
        import coverage
    except ImportError:
        raise SystemExit("coverage.py is not installed: pip install 'coverage>=7.10'") from None
    package = REPO / "src" / "selfevo"
    installed = Path(subprocess.run([sys.executable, "-c", "import selfevo; print(selfevo.__file__)"],
                                    capture_output=True, text=True, check=True).stdout.strip()).parent
    with tempfile.TemporaryDirectory(prefix="selfevo-coverage-") as tmp:
        rc = Path(tmp) / "coveragerc"
        rc.write_text(rc_text(Path(tmp) / ".coverage", package, installed), encoding="utf-8")
        env = {**os.environ, "COVERAGE_RCFILE": str(rc)}
        cov = [sys.executable, "-m", "coverage"]
        # the suite's own output goes on showing (it runs for many minutes); its last lines are kept
        tail: deque[str] = deque(maxlen=5)
        with subprocess.Popen([*cov, "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *args.pytest_args], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True) as proc:
            for line in proc.stdout:
                print(line, end="", flush=True)
                tail.append(line.rstrip("\n"))
        outcome = next((t for t in reversed(tail) if " in " in t and ("passed" in t or "failed" in t)), tail[-1])
        subprocess.run([*cov, "combine", f"--rcfile={rc}", "-q"], cwd=REPO, env=env, check=True)
        subprocess.run([*cov, "json", f"--rcfile={rc}", "-q", "-o", str(Path(tmp) / "coverage.json")], cwd=REPO,
                       env=env, check=True)
        report = json.loads((Path(tmp) / "coverage.json").read_text(encoding="utf-8"))
    totals = report["totals"]
    rows = package_rows(report, package)  # combined under the first of the [paths] aliases
    extra = shlex.join(args.pytest_args)
    command = "python benchmarks/line_coverage.py" + (f" -- {extra}" if extra else "")
    lines = [HEADING, "",
             f"Command: `{command}` (with `pip install 'coverage>=7.10'`)  ",
             f"Machine: {machine_line()}; coverage {coverage.__version__}  ",
             f"Tests: `python -m pytest{' ' + extra if extra else ''}` under "
             f"coverage (exit status {proc.returncode}: {outcome.strip('= ')}), the `selfevo` commands they start "
             "and the worker processes of the local executor and the replay followed; Ray's worker processes not "
             "(code that runs only in a Ray actor counts as not run).  ",
             f"Lines of `src/selfevo` run by a test: **{totals['percent_covered']:.1f}%** "
             f"({totals['covered_lines']} of {totals['num_statements']}); the {len(rows)} files with lines no test "
             f"runs, {totals['missing_lines']} lines in all:", "",
             "| file | statements | not run | lines not run |", "|---|---:|---:|---|",
             *[f"| `{path}` | {n} | {len(missing)} | {line_ranges(missing)} |" for path, n, missing in rows]]
    write_section(args.out, HEADING, "\n".join(lines) + "\n", title="# Reliability")
    print("\n".join(lines))
    if proc.returncode:
        raise SystemExit(f"the tests failed under coverage (exit status {proc.returncode}): see above")


if __name__ == "__main__":
    main()
