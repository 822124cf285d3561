"""Render collected results as Markdown and as one self-contained HTML page (figures inlined)."""

from __future__ import annotations

import base64
import html
import re

from selfevo._fmt import DASH, mean_std_text, num
from selfevo._software import software_text
from selfevo.audit import METRICS, hop_mix_text
from selfevo.replay import TABLE_COLUMNS as REPLAY_COLUMNS
from selfevo.replay import table_rows as replay_rows

# runs collect_runs left out of every number (not complete), listed so the reader knows
LEFT_OUT = "Runs left out (failed or not complete; no number above includes them)"
# what "±" and "[lo, hi]" mean in every table (algos.summary): said once, since "std" alone could be either
STATS_NOTE = ("Over seeds, ± is the sample standard deviation (n − 1) and [lo, hi] a 95% Student-t interval "
              "(n − 1 degrees of freedom; differences to coupled paired by seed); one seed has neither (a dash).")


def _f(s: dict | None, ci: bool = False) -> str:
    if not ci or not s or s.get("mean") is None:
        return mean_std_text(s)
    lo, hi = s.get("lo"), s.get("hi")  # one seed has no interval: a dash, not a made-up "± 0.000"
    return f"{s['mean']:.3f} [{DASH}]" if lo is None else f"{s['mean']:.3f} [{lo:.3f}, {hi:.3f}]"


def _count(s: dict | None) -> str:
    return num(s.get("mean") if s else None, ".0f")


def _gain(s: dict | None) -> str:
    if not s or s.get("mean") is None:  # no seed shared with coupled: undefined, as elsewhere
        return DASH
    if s.get("lo") is None:  # one seed: no interval
        return f"{s['mean']:+.3f} [{DASH}]"
    return f"{s['mean']:+.3f} [{s['lo']:+.3f}, {s['hi']:+.3f}]"


def _audit_note(setting: dict | None) -> str:
    """What the audit table's numbers were judged by (every run's audit shares it: collect_runs checks)."""
    if not setting:
        return ""
    limit = setting.get("max_items_per_step")
    return f"; judge {setting['judge']}" + (f", first {limit} items of every step only" if limit else "")


def seeds_note(res: dict) -> str:
    """Where a run failed or is not complete, not every row is over every seed: say whose are which
    (a row's mean and its paired Δ to coupled can then cover different seeds). Empty when all agree."""
    seeds = {t: d.get("seeds", res["seeds"]) for t, d in res["downstream"].items()}
    if all(s == res["seeds"] for s in seeds.values()):
        return ""
    return ("Not every treatment has every seed (a run failed or is not complete): "
            + "; ".join(f"{t} {', '.join(map(str, s))}" for t, s in seeds.items())
            + ". Each row is over its treatment's seeds, each Δ over the seeds it shares with coupled.")


def tables(res: dict) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Every table as (header, rows), shared by the Markdown and HTML renderings."""
    cols = res["benchmarks"]
    groups = ("macro", "single_hop", "multi_hop")
    t1_head = ["treatment", *cols, "macro", "single-hop", "multi-hop",
               "Δ macro vs coupled", "Δ single-hop", "Δ multi-hop"]
    t1 = [["base (untrained)", *[_f(res["base"].get(c), True) for c in (*cols, *groups)], *[""] * len(groups)]]
    for t, d in res["downstream"].items():
        gains = d.get("gain_vs_coupled", {})
        t1.append([t, *[_f(d.get(c), True) for c in (*cols, *groups)],
                   *["" if t == "coupled" else _gain(gains.get(c)) for c in groups]])
    audit_head = ["treatment", "round", *METRICS, "admitted", "admitted hop mix"]
    audit = [[t, str(r["round"]), *[_f(r[m]) for m in METRICS], _count(r.get("admitted")),
              hop_mix_text(r.get("hop_mix_admitted", {}))] for t, a in res["audit"].items() for r in a["rounds"]]
    # counts do not vary between runs of a schedule; wall time does (runs of seconds share the machine),
    # so its spread over seeds is shown beside it
    comp_head = ["treatment", "generations", "updates", "wall s", "extra generations", "extra updates",
                 "extra wall time (± std over seeds)"]

    def pct(s, spread=False):
        if not s or s.get("mean") is None:
            return DASH
        return f"{s['mean']:+.0%} ± {s['std']:.0%}" if spread and s["n"] > 1 else f"{s['mean']:+.0%}"

    comp = [[t, f"{c['generations']['mean']:.0f}", f"{c['updates']['mean']:.0f}", f"{c['seconds']['mean']:.2f}",
             pct(c["extra_generations"]), pct(c["extra_updates"]), pct(c["extra_seconds"], spread=True)]
            for t, c in res["compute"].items()]
    out = {"Downstream Cover-EM after the last round (mean [95% CI] over seeds)": (t1_head, t1),
           f"Audit by round (mean ± std over seeds{_audit_note(res.get('audit_setting'))})": (audit_head, audit),
           # compare's training cost: compute.json's totals count the evaluations too
           "Compute of the training (the downstream evaluations, the same in every arm, left out) and "
           "overhead against coupled" + (f" ({DASH}: no coupled run of the same seed)" if any(
               DASH in row for row in comp) else ""): (comp_head, comp)}
    if res.get("replay"):
        out["Fixed replay bank (mean ± std over seeds)"] = (
            ["condition", *(title for _, title in REPLAY_COLUMNS)],
            [[n, *[mean_std_text(c.get(k), n=c.get("seeds")) for k, _ in REPLAY_COLUMNS]]
             for n, c in replay_rows(res["replay"])])
    return out


def _cell(text: str) -> str:
    """A Markdown table cell: a benchmark or condition name is the run files' text, and a `|` in it
    would split the cell (the row then has more cells than the header: no table at all), a line
    break would end the row, and `<` would open raw HTML in a renderer."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("\r", " ").replace("\n", " ")


def _text(text: str) -> str:
    """A line of Markdown made of the run files' text (a world path, an error): `<` would open raw HTML
    (but in a `code span`, which shows it as written), a line break end the item. Code spans are found
    as CommonMark finds them: a run of n backticks (not after a backslash) closed by the next run of
    exactly n; an unclosed run is literal backticks."""
    text = text.replace("\r", " ").replace("\n", " ")
    out, i = [], 0
    while i < len(text):
        if text[i] == "`" and not _escaped(text, i):
            n = len(text) - i - len(text[i:].lstrip("`"))  # the opening run
            close = next((m.start() for m in re.finditer(r"`+", text[i + n:]) if len(m.group()) == n), None)
            if close is not None:
                end = i + n + close + n
                out.append(text[i:end])  # a code span: as written
                i = end
                continue
            out.append(text[i:i + n])
            i += n
            continue
        out.append("&lt;" if text[i] == "<" else text[i])
        i += 1
    return "".join(out)


def _escaped(text: str, i: int) -> bool:
    """Is text[i] after an odd number of backslashes (a literal character in Markdown)?"""
    return (i - len(text[:i].rstrip("\\"))) % 2 == 1


def _code(text: str) -> str:
    """`text` as one code span, whatever backticks it holds: a fence longer than its longest run."""
    n = max((len(m.group()) for m in re.finditer(r"`+", text)), default=0) + 1
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{'`' * n}{pad}{text.replace(chr(13), ' ').replace(chr(10), ' ')}{pad}{'`' * n}"


def users_pieces_text(res: dict) -> str:
    """Whose learners and rules made the numbers, where a user's did (results.json's `learners`, `rules`)."""
    said = [f"learners {res['learners']} (a user's: every run)"] if res.get("learners") else []
    said += [f"treatment {t}'s rules {f} (a user's)" for t, f in res.get("rules", {}).items()]
    return f"Made with: {'; '.join(said)}." if said else ""


def markdown(res: dict, figures: dict[str, str]) -> str:
    lines = ["# selfevo report", "", _text(f"Treatments: {', '.join(res['treatments'])}; seeds: "
                                          f"{', '.join(map(str, res['seeds']))}. {res.get('context', '')}"), "",
             _text(f"Software: {software_text(res.get('software', {}))}."), "", STATS_NOTE, ""]
    lines += [_text(made), ""] if (made := users_pieces_text(res)) else []
    lines += [_text(note), ""] if (note := seeds_note(res)) else []
    lines += ["## Readings", ""]
    lines += [f"- {_text(r)}" for r in res["readings"]] or ["- (none)"]
    if res.get("excluded"):
        lines += ["", f"## {LEFT_OUT}", ""]
        lines += [f"- {_code(r['run'])} ({_text(r['treatment'])} seed {r['seed']}): {_text(r['why'])}"
                  for r in res["excluded"]]
    for title, (head, rows) in tables(res).items():
        lines += ["", f"## {_text(title)}", "", "| " + " | ".join(map(_cell, head)) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(map(_cell, r)) + " |" for r in rows]
    lines += ["", "## Figures", ""]
    lines += [f"![{caption}]({path})" for caption, path in figures.items()]
    return "\n".join(lines) + "\n"


def html_page(res: dict, figures: dict[str, bytes]) -> str:
    esc = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>selfevo report</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;"
             "color:#222}table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;"
             "padding:3px 7px;text-align:right}td:first-child,th:first-child{text-align:left}"
             "figure{margin:1.5em 0}img{max-width:100%}li{margin:.3em 0}</style></head><body>",
             "<h1>selfevo report</h1>",
             f"<p>Treatments: {esc(', '.join(res['treatments']))}; seeds: {esc(', '.join(map(str, res['seeds'])))}."
             f" {esc(res.get('context', ''))}</p>",
             f"<p>Software: {esc(software_text(res.get('software', {})))}.</p>", f"<p>{esc(STATS_NOTE)}</p>",
             *([f"<p>{esc(made)}</p>"] if (made := users_pieces_text(res)) else []),
             *([f"<p>{esc(note)}</p>"] if (note := seeds_note(res)) else []), "<h2>Readings</h2><ul>"]
    parts += [f"<li>{esc(r)}</li>" for r in res["readings"]] or ["<li>(none)</li>"]
    parts.append("</ul>")
    if res.get("excluded"):
        parts.append(f"<h2>{esc(LEFT_OUT)}</h2><ul>")
        parts += [f"<li><code>{esc(r['run'])}</code> ({esc(r['treatment'])} seed {r['seed']}): {esc(r['why'])}</li>"
                  for r in res["excluded"]]
        parts.append("</ul>")
    for title, (head, rows) in tables(res).items():
        parts.append(f"<h2>{esc(title)}</h2><table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    parts.append("<h2>Figures</h2>")
    for caption, png in figures.items():
        data = base64.b64encode(png).decode()
        parts.append(f"<figure><img alt='{esc(caption)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{esc(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)
