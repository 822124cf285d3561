"""The package on other Pythons than the one this machine's venv has (pyproject: requires-python >= 3.10).

    python benchmarks/pythons.py --python /root/.pyenv/versions/3.10.13/bin/python \
        /root/.pyenv/versions/3.12.1/bin/python /root/.pyenv/versions/3.13.0/bin/python [--out docs/reliability.md]

For each interpreter: a fresh venv, the package as the README installs it (`pip install -e .`, no extras:
pip picks each dependency's newest release for that Python) with pytest and hypothesis, then `selfevo demo`
and the golden-number tests (tests/test_golden.py and the replay's); the demo's report and run files are
compared with those the interpreter running this script makes (its own `selfevo`). The report's compute
section and wall-time lines are left out of the comparison (they are timings), and so are each run's
manifest.json and compute.json (they record the software and the timings).

Writes the "## Other Pythons" section of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, machine_line, write_section

HEADING = "## Other Pythons"
GOLDEN_TESTS = ["tests/test_golden.py", "tests/test_replay.py::test_replay_golden_numbers"]


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(list(map(str, cmd)), capture_output=True, text=True, cwd=REPO, **kw)


def versions(python: Path) -> dict:
    code = ("import sys, importlib.metadata as m; print(sys.version.split()[0], m.version('numpy'), "
            "m.version('bm25s'))")
    out = run([python, "-c", code]).stdout.split()
    return dict(zip(("python", "numpy", "bm25s"), out))


def tables(report: Path) -> list[str]:
    """The report's lines but its timings: the compute section, the wall-time and software lines."""
    kept, skipping = [], False
    for line in report.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            skipping = line.startswith("## Compute")
        if not skipping and "wall time" not in line and not line.startswith("Software"):
            kept.append(line)
    return kept


def run_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "runs").rglob("*"))
            if p.is_file() and p.name not in ("manifest.json", "compute.json")}


def parsed(data: bytes) -> list:
    text = data.decode("utf-8")
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:  # a JSONL log
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def differences(a, b) -> tuple[int, float]:
    """(values that differ other than as numbers, the largest absolute difference of two numbers); timings
    (a checkpoint's compute `seconds`) left out."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        parts = [differences(a[k], b[k]) for k in a if k != "seconds"]
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        parts = [differences(x, y) for x, y in zip(a, b)]
    elif isinstance(a, float) and isinstance(b, float):
        return 0, abs(a - b)
    else:
        return int(a != b), 0.0
    return sum(p[0] for p in parts), max((p[1] for p in parts), default=0.0)


def demo(selfevo: Path, out: Path) -> float:
    t = time.perf_counter()
    r = run([selfevo, "demo", "--out", out])
    if r.returncode:
        raise SystemExit(f"{selfevo} demo failed (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return time.perf_counter() - t


def check(python: Path, root: Path, reference: Path) -> dict:
    venv = root / f"venv-{python.parent.parent.name}"
    t = time.perf_counter()
    pip = [venv / "bin" / "pip", "install", "-q", "-e", REPO, "pytest", "hypothesis"]
    for step in ([python, "-m", "venv", venv], pip):
        done = run(step)
        if done.returncode:
            raise SystemExit(f"{python}: install failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    install_s = time.perf_counter() - t
    out = root / f"demo-{venv.name}"
    demo_s = demo(venv / "bin" / "selfevo", out)
    tests = run([venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *GOLDEN_TESTS])
    summary = (tests.stdout.strip().splitlines() or ["no output"])[-1]
    ref_files, files = run_files(reference), run_files(out)
    other, most, same = 0, 0.0, 0
    for k, v in ref_files.items():
        if files.get(k) == v:
            o, d = 0, 0.0
        elif k in files:
            o, d = differences(parsed(v), parsed(files[k]))
        else:  # a file the reference has and this Python's run lacks
            o, d = 1, 0.0
        other, most, same = other + o, max(most, d), same + (o == 0 and d == 0.0)
    return {**versions(venv / "bin" / "python"), "install_s": install_s, "demo_s": demo_s,
            "tests": re.sub(r" in [\d.]+s.*", "", summary.strip("= ")), "tests_ok": tests.returncode == 0,
            "same_tables": tables(out / "report.md") == tables(reference / "report.md"),
            "same_files": same, "files": len(ref_files),
            "other_values": other, "max_diff": most}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", type=Path, nargs="+", required=True, help="interpreters to check")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "reliability.md")
    args = ap.parse_args()
    here = versions(Path(sys.executable))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference = root / "demo-reference"
        demo(Path(sys.executable).parent / "selfevo", reference)
        rows = [check(p, root, reference) for p in args.python]
    lines = [HEADING, "",
             "Command: `python benchmarks/pythons.py --python " + " ".join(str(p) for p in args.python) + "`  ",
             f"Machine: {machine_line()}  ",
             f"Reference: this machine's venv (Python {here['python']}, numpy {here['numpy']}, bm25s "
             f"{here['bm25s']}); each other Python gets a fresh venv with the package as the README installs it "
             "(no extras: pip takes each dependency's newest release for that Python), then `selfevo demo` "
             "(configs/demo.toml: 4 treatments × 3 seeds, the replay study, the report) and the golden-number "
             "tests (tests/test_golden.py, the replay's). `tables`: the demo's report, timings left out, the same "
             "as the reference's; `run files`: the demo's run files (manifests and compute.json left out) the same "
             "as the reference's, byte for byte but for the wall seconds a checkpoint holds; over all of them, the "
             "values that differ other than as two numbers, and the largest absolute difference of two numbers.", "",
             "| Python | numpy | bm25s | install | `selfevo demo` | golden tests | tables | run files | other values "
             "| largest difference |",
             "|---|---|---|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['python']} | {r['numpy']} | {r['bm25s']} | {r['install_s']:.0f} s | {r['demo_s']:.0f} s | "
                     f"{r['tests']} | {'same' if r['same_tables'] else '**differ**'} | "
                     f"{r['same_files']} of {r['files']} | {r['other_values']} | {r['max_diff']:.1e} |")
    write_section(args.out, HEADING, "\n".join(lines) + "\n", title="# Reliability")
    print("\n".join(lines))
    if not all(r["tests_ok"] and r["same_tables"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
