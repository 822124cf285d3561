"""`selfevo report DIR`: collect every run below DIR (and DIR/replay/results.json if present) into
DIR/results.json, DIR/report.md (+ DIR/figures/*.png) and one self-contained DIR/report.html. A
demo's --out holds DIR/demo.json: then only that demo's runs and replay study."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from selfevo._io import write_all_atomically, write_json
from selfevo.replay import TABLE_COLUMNS as REPLAY_COLUMNS
from selfevo.report import figures as figs
from selfevo.report.collect import collect_runs, find_runs
from selfevo.report.render import html_page, markdown
from selfevo.runs import _TYPE_NAMES, RunDir, RunError, check_numbers, read_object

DEMO_RECORD = "demo.json"
REPORT_FILES = ("results.json", "report.md", "report.html", "figures")  # what a report writes in its DIR
# what demo.json says of each planned run that left no run directory (the report lists them)
_EXCLUDED_FIELDS = {"run": str, "treatment": str, "seed": int, "why": str}


def write_demo_record(root: str | os.PathLike, runs: Sequence[str | os.PathLike], replay: bool,
                      excluded: Sequence[dict], context: str) -> None:
    """root/demo.json: the runs of the demo that wrote root, whether root/replay is its study, and
    what its report says besides. A rerun with another plan leaves the earlier plan's runs and study
    below root, which `build_report(root)` would otherwise report as this plan's."""
    root = Path(root)
    write_json(root / DEMO_RECORD, {"format": 1, "runs": [os.path.relpath(r, root) for r in runs],
                                    "replay": replay, "excluded": list(excluded), "context": context})


def _demo_record(root: Path) -> dict:
    path = root / DEMO_RECORD
    record = read_object(path)
    runs, replay, excluded = record.get("runs"), record.get("replay"), record.get("excluded")
    if (not isinstance(runs, list) or not all(isinstance(r, str) for r in runs) or not isinstance(replay, bool)
            or not isinstance(excluded, list) or not all(isinstance(x, dict) for x in excluded)
            or not isinstance(record.get("context"), str)):
        raise RunError(f"{path}: expected runs (run directories), replay (true or false), excluded (a list of "
                       "objects) and context (a string), as `selfevo demo` writes them")
    for i, x in enumerate(excluded):  # the report lists each one by these fields
        for field, kind in _EXCLUDED_FIELDS.items():
            if not isinstance(x.get(field), kind) or isinstance(x.get(field), bool):
                raise RunError(f"{path}: field excluded[{i}].{field} should be {_TYPE_NAMES[kind]}, "
                               f"got {x.get(field)!r:.60}")
    return record


def _since_the_demo(left_out: dict) -> dict:
    """A run the demo left out (its job failed) that has been finished since (`evolve --resume` by hand):
    the report still follows the demo's plan, so it says how to take it in."""
    run = RunDir(left_out["run"])
    try:
        finished = run.exists() and run.manifest().get("status") == "complete"
    except RunError:
        finished = False
    return {**left_out, "why": f"{left_out['why']}; its run directory holds a complete run now: the same "
                              "`selfevo demo` again reports it"} if finished else left_out


def build_report(root: str | os.PathLike, context: str = "", runs: Sequence[str | os.PathLike] | None = None,
                 replay: bool = True, excluded: Sequence[dict] = ()) -> dict:
    """The report of `runs` (None: those root/demo.json names, else every run directory below
    `root`) and, with `replay`, of root/replay/results.json if present (and, under demo.json, the
    demo's own); `excluded` lists planned runs that left no run directory (as collect_runs lists
    the unfinished ones)."""
    root = Path(root)
    if runs is None and (root / DEMO_RECORD).exists():  # a demo's --out: that demo's plan, nothing else
        demo = _demo_record(root)
        runs = [root / r for r in demo["runs"]]
        replay = replay and demo["replay"]
        excluded = [*map(_since_the_demo, demo["excluded"]), *excluded]
        note = (f"The runs{' and replay study' if demo['replay'] else ''} of the demo recorded in "
                f"{DEMO_RECORD}; other runs below this directory are not reported.")
        context = " ".join(x for x in (note, demo["context"], context) if x)
    if runs is None and not root.is_dir():
        raise ValueError(f"{root}: " + ("not a directory (give the directory that holds the runs)" if root.exists()
                                        else "no such directory"))
    runs = find_runs(root) if runs is None else runs
    if not runs:
        raise ValueError(f"{root}: no run directories found below it")
    res = collect_runs(runs)
    res["context"] = context
    res["excluded"] += excluded
    replay_results = root / "replay" / "results.json"
    replay = replay and replay_results.exists()
    if replay:
        res["replay"] = read_object(replay_results)
        conditions = res["replay"].get("conditions")  # what the replay table reads of it
        if not isinstance(conditions, dict) or not all(isinstance(c, dict) for c in conditions.values()):
            raise RunError(f"{replay_results}: field 'conditions' should be an object of objects")
        reference = res["replay"].get("reference", {})
        if not isinstance(reference, dict) or not isinstance(reference.get("base", {}), dict):
            raise RunError(f"{replay_results}: field 'reference' should be an object with an object 'base'")
        entries = [(f"conditions.{name}", c) for name, c in conditions.items()]
        for where, c in entries + ([("reference.base", reference["base"])] if "base" in reference else []):
            for metric, _ in REPLAY_COLUMNS:
                check_numbers(c.get(metric), ("mean", "std"), f"{replay_results}: field {where}.{metric}")
        # the study sits beside the runs, but its bank may come from others: say so where it does
        bank = res["replay"].get("bank") or {}
        if not isinstance(bank, dict):
            raise RunError(f"{replay_results}: field 'bank' should be an object, got {bank!r:.60}")
        sources = bank.get("sources")
        if not isinstance(sources, list) or not all(isinstance(x, str) for x in sources):
            raise RunError(f"{replay_results}: field bank.sources should be a list of run directories")
        from selfevo.replay import creation_times_ok

        created = bank.get("source_created") or [None] * len(sources)  # (a study from before it was kept)
        if not creation_times_ok(created, len(sources)):
            raise RunError(f"{replay_results}: field bank.source_created should be a list of numbers (or null), "
                           "one per source")
        mine = {Path(r).resolve() for r in runs}
        # a run is known by its path, or by its manifest's creation time where the directory was moved
        made = {RunDir(r).manifest().get("created") for r in runs} - {None}
        outside = [x for x, c in zip(sources, created) if Path(x).resolve() not in mine and c not in made]
        if outside:
            res["readings"].append(f"The fixed replay bank's questions come from run(s) not in this report "
                                   f"({', '.join(outside)}): its numbers describe those runs, not these.")
    pngs: dict[str, bytes] = {}
    # runs made with --no-audit have no audit numbers: no empty figure captioned as if it held them
    # (the readings name those runs)
    if res["audit"].get("coupled", {}).get("steps"):
        pngs["Coupled loop: A, T_P, T_S, F, L by scheduled step (mean over seeds; Figure 1/3 analogue)"] = \
            figs.steps_figure(res["audit"]["coupled"]["steps"], "coupled (Dr. Zero) loop")
    if any(a["rounds"] for a in res["audit"].values()):
        pngs["A, T_P and F by round per treatment (mean ± std over seeds; Figure 5/6 analogue)"] = \
            figs.rounds_figure(res["audit"])
    if replay and (root / "replay" / "replay.png").exists():
        pngs["Fixed replay bank (Figure 7 analogue)"] = (root / "replay" / "replay.png").read_bytes()
    # a point needs a gain (a seed shared with coupled) and an overhead: no empty axes captioned as a plot
    if any(t != "coupled" and (d.get("gain_vs_coupled", {}).get("macro") or {}).get("mean") is not None
           and res["compute"].get(t, {}).get("extra_seconds", {}).get("mean") is not None
           for t, d in res["downstream"].items()):
        pngs["Downstream gain vs compute: macro Cover-EM gain (95% interval) against the extra wall time "
             "(± std over seeds: single runs of seconds time noisily), generations and updates over coupled"] = \
            figs.cost_figure(res["downstream"], res["compute"])
    # strict JSON: an undefined statistic is null, and a NaN or infinity that slips in is a bug to
    # raise here, not `NaN` in a file other JSON readers (browsers, Node, jq) refuse
    try:
        text = json.dumps(res, default=str, indent=2, allow_nan=False) + "\n"
    except ValueError as e:
        raise ValueError(f"{root / 'results.json'}: not written, a result is not a finite number ({e})") from None
    paths = {caption: f"figures/figure-{i + 1}.png" for i, caption in enumerate(pngs)}
    # all or none: a report that cannot be written whole (a full disk) leaves the previous one as it was
    write_all_atomically({**{root / paths[c]: png for c, png in pngs.items()},
                          root / "results.json": text.encode("utf-8"),
                          root / "report.md": markdown(res, paths).encode("utf-8"),
                          root / "report.html": html_page(res, pngs).encode("utf-8")})
    for old in (root / "figures").glob("figure-*.png"):  # a previous report's extra figure would
        if f"figures/{old.name}" not in paths.values():  # sit beside this one as if it were its own
            old.unlink()
    return res
