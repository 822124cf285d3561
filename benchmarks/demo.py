"""Time `selfevo demo` (the README's main job) from a fresh output directory, median of 3; time the
whole path a new user takes, a fresh clone of this repository's HEAD and the README's first command
run in it as written (venv, installs, `selfevo demo`), median of 3; and check that the report renders
in headless Chromium (Debian's `chromium`), saving a screenshot. The last timed run's report also
gives the README its figure (A, T_P and F by round per treatment, docs/figures/demo-rounds.png).

    python benchmarks/demo.py [--repeats 3] [--fresh-clones 3] [--out docs/results.md]

Writes the "## The demo" section of docs/results.md and the README's headline (between its
`<!-- demo-headline -->` lines).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, cpu_model, machine_line, write_block, write_section

from selfevo._fmt import mean_std_text, shown
from selfevo.report.figures import rounds_figure

HEADING = "## The demo"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def render(html: Path, png: Path) -> str:
    """Screenshot the page with headless Chromium; returns what happened, in words."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        return "not checked: no chromium on this machine (apt-get install chromium)"
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1300,2400",
                               f"--screenshot={png}", html.resolve().as_uri()],
                              capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not png.exists() or png.stat().st_size < 10_000:
        return f"FAILED (exit {proc.returncode}): {proc.stderr[-300:]}"
    return f"rendered by {exe}: screenshot {png.relative_to(REPO)} ({png.stat().st_size // 1024} KiB)"


def headline(demo: dict) -> list[str]:
    """The README's headline table from the last timed run's results.json: round-3 audit metrics
    (mean ± std over seeds) and macro Cover-EM with the paired Δ to coupled (mean [95% t-interval])."""
    lines = [f"Headline of the last timed run (seeds {', '.join(map(str, demo['seeds']))}), "
             "round 3, mean ± std over seeds:", "",
             "| treatment | A | T_P | F | macro Cover-EM | Δ vs coupled [95% CI] |", "|---|---:|---:|---:|---:|---:|"]
    for t in demo["treatments"]:
        last = demo["audit"][t]["rounds"][-1]
        cells = [mean_std_text(last[m]) for m in ("A", "T_P", "F")]  # one seed: a dash for the std
        ds = demo["downstream"][t]
        gain = (ds.get("gain_vs_coupled") or {}).get("macro")
        ok = gain and gain["lo"] is not None
        cells += [f"{ds['macro']['mean']:.3f}",
                  f"{gain['mean']:+.3f} [{gain['lo']:+.3f}, {gain['hi']:+.3f}]" if ok else ""]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


def by_round(demo: dict, t: str, m: str) -> str:
    """Audit metric `m` of treatment `t` by round (means over seeds), as "a → b → c"."""
    return " → ".join(f"{r[m]['mean']:.3f}" for r in demo["audit"][t]["rounds"])


def rises(demo: dict, t: str, m: str) -> bool:
    """Audit metric `m` of treatment `t` rising every round as printed: a rise the decimals do not show
    ("0.060 → 0.060") is none, as in the report's reading."""
    values = [shown(r[m]["mean"]) for r in demo["audit"][t]["rounds"]]
    return all(a < b for a, b in zip(values, values[1:]))


def last_round(demo: dict, t: str, m: str) -> float:
    """Audit metric `m` of treatment `t` in the last round, mean over seeds."""
    return demo["audit"][t]["rounds"][-1][m]["mean"]


def readme_headline(demo: dict, walls: list[float], clones: list[float]) -> list[str]:
    """The README's headline: the timing, the table and what it shows, each claim checked against the
    numbers it states."""
    last = functools.partial(last_round, demo)
    seeds = ", ".join(map(str, demo["seeds"]))
    clone = (f"; {statistics.median(clones):.0f} s from a fresh clone with the first command as written"
             if clones else "")
    lines = [f"`selfevo demo --out /tmp/demo` (configs/demo.toml: default world, seeds {seeds}), on a "
             f"{os.cpu_count()}-core machine ({cpu_model()}), {dt.date.today().isoformat()}: "
             f"{statistics.median(walls):.0f} s median of {len(walls)}{clone} (`benchmarks/demo.py`, which "
             "writes this paragraph and the table; target: under 3 minutes; the machine's speed varies from "
             "day to day: `docs/results.md`, \"The demo\"). A = in-loop agreement, T_P = label truth, "
             "F = false agreement:", "", *headline(demo), ""]
    rising = rises(demo, "coupled", "F") and rises(demo, "coupled", "A")
    claims = [f"Coupled F goes {by_round(demo, 'coupled', 'F')} over the rounds, A {by_round(demo, 'coupled', 'A')} "
              f"and label truth T_P {by_round(demo, 'coupled', 'T_P')}"
              + (": rising agreement is partly co-cheating." if rising else ".")]
    if "crossfit" in demo["audit"]:
        cut = 1 - last("crossfit", "F") / last("coupled", "F")
        regression = last("crossfit", "A") < last("coupled", "A") and last("crossfit", "T_P") > last("coupled", "T_P")
        claims.append(f"CrossFit cuts round-3 F by {cut:.0%}"
                      + (" with *lower* in-loop agreement and higher label truth (what an operator watching only A "
                         "would call a regression)." if regression else "."))
    claims.append(f"The untrained base scores {demo['base']['macro']['mean']:.3f} macro Cover-EM.")
    return [*lines, " ".join(claims)]


def acceptance(demo: dict, clones: list[float]) -> list[str]:
    """Issue 7's acceptance items on the last timed run: the paper's qualitative findings, each as
    PASS or FAIL with its numbers (means over the run's seeds)."""
    last = functools.partial(last_round, demo)

    checks = []
    if clones:
        checks.append(("fresh clone → the README's first command → report in under 3 minutes (median)",
                       statistics.median(clones) < 180, f"{statistics.median(clones):.0f} s"))
    checks.append(("coupled F rising by round", rises(demo, "coupled", "F"), by_round(demo, "coupled", "F")))
    co, cf = ({m: last(t, m) for m in ("F", "A", "T_P")} for t in ("coupled", "crossfit"))
    checks.append(("CrossFit halving F with lower A and higher T_P",
                   cf["F"] <= 0.5 * co["F"] and cf["A"] < co["A"] and cf["T_P"] > co["T_P"],
                   f"F {cf['F']:.3f} vs {co['F']:.3f}, A {cf['A']:.3f} vs {co['A']:.3f}, "
                   f"T_P {cf['T_P']:.3f} vs {co['T_P']:.3f}"))
    if "msv" in demo["audit"]:
        msv = last("msv", "F")
        # an effect either way: an MSV that raised F a lot has no small effect
        checks.append(("MSV's effect on F smaller than CrossFit's", abs(co["F"] - msv) < abs(co["F"] - cf["F"]),
                       f"F {co['F']:.3f} → MSV {msv:.3f}, CrossFit {cf['F']:.3f}"))
    if demo.get("replay"):
        rp = {n: demo["replay"]["conditions"][n]["F"]["mean"] for n in ("question-split", "source-id")}
        ratio = rp["source-id"] / rp["question-split"]
        checks.append(("replay bars: source-id F below question-split F", rp["source-id"] < rp["question-split"],
                       f"{rp['source-id']:.3f} vs {rp['question-split']:.3f} (ratio {ratio:.2f}; issue 6's ≤ 0.2 is "
                       f"{'met' if ratio <= 0.2 else 'not met'}: see \"Fixed replay bank\")"))
    gain = demo["downstream"]["crossfit"]["gain_vs_coupled"]["macro"]
    checks.append(("CrossFit's downstream gain with a 95% interval excluding 0",
                   gain["lo"] is not None and gain["lo"] > 0,
                   f"{gain['mean']:+.3f} [{gain['lo']:+.3f}, {gain['hi']:+.3f}]" if gain["lo"] is not None
                   else f"{gain['mean']:+.3f} (one seed: no interval)"))
    return ["Acceptance (issue 7), on the last timed run (`--executor ray` giving byte-identical tables is "
            "`tests/test_experiments_report.py::test_ray_matches_local`, run by CI):", "",
            *(f"- {'PASS' if ok else '**FAIL**'} {name}: {detail}" for name, ok, detail in checks)]


def readme_main_job() -> str:
    """The README's first command: the line under "# run the main job" (as .ci/run reads the tests')."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    return lines[lines.index("# run the main job") + 1]


def time_fresh_clone(tmp: Path, command: str) -> float:
    """Clone HEAD into `tmp` and run `command` (the README's first) there, as a new user would."""
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    start = time.perf_counter()
    subprocess.run(["bash", "-c", command], cwd=clone, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
    wall = time.perf_counter() - start
    if not (clone / "runs" / "demo" / "report.html").exists():
        raise SystemExit("the README's first command wrote no runs/demo/report.html")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fresh-clones", type=int, default=3, help="0: skip the fresh-clone timing")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    ap.add_argument("--no-readme", dest="readme", action="store_false", help="leave the README's headline")
    args = ap.parse_args()
    walls = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            out = Path(tmp) / f"demo-{i}"
            load_before = os.getloadavg()
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "selfevo.cli", "demo", "--out", str(out)], check=True,
                           stdout=subprocess.DEVNULL)
            walls.append(time.perf_counter() - start)
            print(f"run {i + 1}: {walls[-1]:.1f} s (load average before {load_before[0]:.1f})", flush=True)
        shot = REPO / "docs" / "figures" / "demo-report.png"
        shot.unlink(missing_ok=True)  # a screenshot of an older report is no check of this one
        rendered = render(out / "report.html", shot)
        sizes = {p.name: p.stat().st_size for p in out.iterdir() if p.is_file()}
        demo = json.loads((out / "results.json").read_text())  # the last timed run: the README's headline
        # and its figure: the report's Figure 5/6 analogue, drawn again from the numbers it was drawn from
        (REPO / "docs" / "figures" / "demo-rounds.png").write_bytes(rounds_figure(demo["audit"]))
    clones, main_job = [], readme_main_job()
    for i in range(args.fresh_clones):
        with tempfile.TemporaryDirectory() as tmp:
            clones.append(time_fresh_clone(Path(tmp), main_job))
        print(f"fresh clone {i + 1}: {clones[-1]:.1f} s", flush=True)
    lines = [HEADING, "",
             f"Command: `python benchmarks/demo.py --repeats {args.repeats} --fresh-clones {args.fresh_clones}` (runs "
             f"`selfevo demo` from a fresh output directory, {args.repeats} times, then the README's first command in "
             f"{args.fresh_clones} fresh clone{'s' if args.fresh_clones != 1 else ''})  ",
             f"Machine: {machine_line()}  ",
             f"Wall time of `selfevo demo` ({len(demo['treatments'])} treatments × seeds "
             f"{', '.join(map(str, demo['seeds']))} (configs/demo.toml), the audit, the "
             "evaluation after every round, the replay study, the report): "
             f"**{statistics.median(walls):.0f} s** median "
             f"(runs: {', '.join(f'{w:.0f}' for w in walls)} s). Target: under 3 minutes.  ",
             f"Report files: {', '.join(f'{k} ({v // 1024} KiB)' for k, v in sorted(sizes.items()))}.  ",
             *([f"Fresh clone of HEAD → the README's first command as written (`{main_job}`: venv, "
                "the package and its dependencies, `selfevo demo`, report in runs/demo): "
                f"**{statistics.median(clones):.0f} s** median (runs: {', '.join(f'{w:.0f}' for w in clones)} s; "
                "pip takes wheels from this machine's local wheel directory and file indexes (its pip config) "
                "where they are there; a machine that downloads every wheel takes longer). Target: under "
                "3 minutes.  "] if clones else []),
             f"Headless Chromium: {rendered}.", "",
             *headline(demo), "", *acceptance(demo, clones), ""]
    write_section(args.out, HEADING, "\n".join(lines))
    if args.readme:
        write_block(REPO / "README.md", "demo-headline", "\n".join(readme_headline(demo, walls, clones)))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
