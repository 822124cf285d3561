"""Progress in a log: where the console is not a terminal, rich draws no bar, so the bar writes plain
lines to stderr (throttled); a terminal gets the bar alone."""

import functools
import io
import re
import time

import pytest
from rich.console import Console
from rich.progress import TextColumn

import selfevo.loop.engine as engine
from selfevo._bar import Progress
from selfevo.config import load_config
from selfevo.evolve import evolve

LINE = re.compile(r"^\d\d:\d\d:\d\d (.+): (\d+)(?:/(\d+))? \(\d+m\d\ds\)$")


def lines(text: str) -> list[tuple[str, str]]:
    found = [LINE.match(line) for line in text.splitlines()]
    assert all(found), text
    return [(m.group(1), m.group(2)) for m in found]


def test_a_bar_that_cannot_draw_writes_each_change_to_stderr_and_its_end(capsys):
    log = Console(file=io.StringIO())  # a file: not a terminal
    with Progress(TextColumn("{task.description}"), console=log, every=0, auto_refresh=False) as bar:
        task = bar.add_task("eval main", total=3)
        bar.advance(task)
        bar.advance(task, 0)  # no change: no line
        bar.update(task, description="eval main (batch 2)")
        bar.advance(task, 2)
    out = capsys.readouterr()
    assert lines(out.err) == [("eval main", "0"), ("eval main", "1"), ("eval main (batch 2)", "1"),
                              ("eval main (batch 2)", "3")]
    assert "/3 (" in out.err and out.out == ""


def test_lines_are_throttled_and_quick_work_writes_none(capsys, monkeypatch):
    clock = [0]
    monkeypatch.setattr("selfevo._bar.time.monotonic", lambda: clock[0])
    with Progress(console=Console(file=io.StringIO()), every=25, auto_refresh=False) as bar:  # began at 0
        task = bar.add_task("steps", total=None)
        for _ in range(6):
            clock[0] += 10
            bar.advance(task)  # at 10, 20, ... 60 s: lines at 30 and 60 (every 25 s at most)
        clock[0] += 5
        bar.advance(task)  # at 65 s: held back, then written as the last state
    assert lines(capsys.readouterr().err) == [("steps", "3"), ("steps", "6"), ("steps", "7")]

    with Progress(console=Console(file=io.StringIO()), every=3600, auto_refresh=False) as bar:
        task = bar.add_task("steps", total=2)
        bar.advance(task, 2)
    assert capsys.readouterr().err == ""  # nothing was written before its end: nothing at its end

    with Progress(console=Console(file=io.StringIO()), every=0, auto_refresh=False) as bar:  # an index's passages
        bar.advance(bar.add_task("indexing", total=21_000_000), 1_230_000)
    err = capsys.readouterr().err
    assert lines(err) == [("indexing", "0"), ("indexing", "1230000")] and "1230000/21000000 (" in err  # not 1.23e+06


def test_a_change_held_back_is_written_once_due_with_no_further_update(capsys):
    """A loop phase that began within `every` of the last line (its description set, then hours of
    work with no update) still shows: the display's refresh thread writes it once due."""
    with Progress(console=Console(file=io.StringIO()), every=0.5, refresh_per_second=20) as bar:
        task = bar.add_task("round 1 proposer step 1", total=4)
        bar.update(task, description="round 1 auxiliary solvers")  # at once: not due
        deadline, err = time.monotonic() + 10, ""  # due in 0.5 s: waited for, not slept on (a loaded machine)
        while "auxiliary" not in err and time.monotonic() < deadline:
            time.sleep(0.05)
            err += capsys.readouterr().err
        assert lines(err) == [("round 1 auxiliary solvers", "0")]
    assert capsys.readouterr().err == ""  # its end: nothing changed since


def test_a_terminal_or_a_disabled_bar_writes_no_lines(capsys):
    for kwargs in ({"console": Console(file=io.StringIO(), force_terminal=True)},
                   {"console": Console(file=io.StringIO()), "disable": True}):
        with Progress(every=0, **kwargs) as bar:
            task = bar.add_task("eval", total=2)
            bar.advance(task, 2)
        assert capsys.readouterr().err == ""


def test_an_evolve_log_names_each_phase_of_the_loop(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(engine, "Progress", functools.partial(Progress, every=0))
    cfg = load_config(None, ["world.name=small", "loop.rounds=2", "loop.proposer_steps=2", "loop.solver_steps=1",
                             "treatment=crossfit"])
    evolve(cfg, tmp_path / "run", progress=True, audit=False)
    err = capsys.readouterr().err
    assert re.search(r"^eval main .*1325/1325", err, re.M)  # round 0: the evaluation's own bar, drawn at its end
    logged = lines("\n".join(line for line in err.splitlines() if LINE.match(line)))
    phases = [d for i, (d, _) in enumerate(logged) if i == 0 or d != logged[i - 1][0]]
    assert phases == ["evolve", "round 1 proposer step 1", "round 1 proposer step 2", "round 1 solver step 1",
                      "round 1 auxiliary solvers", "round 1 evaluation",
                      "round 2 proposer step 1", "round 2 proposer step 2", "round 2 solver step 1",
                      "round 2 evaluation"]  # none trained after the last round
    assert logged[-1] == ("round 2 evaluation", "6")


def test_a_removed_task_neither_breaks_the_stop_nor_hides_the_error_leaving_the_block(capsys):
    # before: stop() reported every task ever logged, and a removed one raised KeyError there, in
    # place of the block's own error, with the display left running (a helper's review)
    log = Console(file=io.StringIO())
    with pytest.raises(RuntimeError, match="^the real error$"), \
            Progress(TextColumn("{task.description}"), console=log, every=0, auto_refresh=False) as bar:
        task = bar.add_task("index", total=10)
        bar.advance(task)
        bar.remove_task(task)
        raise RuntimeError("the real error")
    assert not bar.live.is_started
    assert lines(capsys.readouterr().err)[-1] == ("index", "1")


def test_a_line_shows_a_fractional_count_to_one_decimal_the_elapsed_time_and_is_due_at_every(capsys, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("selfevo._bar.time.monotonic", lambda: clock[0])
    with Progress(console=Console(file=io.StringIO()), every=10, auto_refresh=False, get_time=lambda: clock[0]) as bar:
        task = bar.add_task("GB read", total=2.5)
        clock[0] = 10.0
        bar.advance(task, 1 / 3)  # `every` seconds after the last line: due, not held back
        assert capsys.readouterr().err.endswith(" GB read: 0.3/2.5 (0m10s)\n")
        clock[0] = 75.0
        bar.advance(task, 1)
    assert capsys.readouterr().err.endswith(" GB read: 1.3/2.5 (1m15s)\n")


def test_a_bar_writes_nothing_on_stdout(capsys):
    """stdout may be a command's data: `selfevo replay run ... | head -1` closed it early, the bar's last
    write there ended the command (EPIPE) before it wrote its results. A bar draws on stderr."""
    with Progress(every=0) as bar:
        bar.advance(bar.add_task("replay", total=2), 2)
    captured = capsys.readouterr()
    assert captured.out == "" and "replay" in captured.err
