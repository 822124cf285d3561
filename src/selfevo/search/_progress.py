"""The progress display of long index work (encoding passages, indexing a corpus)."""

from __future__ import annotations

import os

from selfevo.corpus import count_lines


def corpus_total(path: str | os.PathLike, show: bool) -> int | None:
    """The total of a build's bar over the corpus file `path`: its lines, counted (no parse) only
    when the bar is shown."""
    return count_lines(path) if show else None


class ProgressBar:
    """A rich progress bar (or nothing) that yields an `advance(n)` callable (`total` None: a count)."""

    def __init__(self, show: bool, total: int | None, what: str):
        self.show, self.total, self.what = show, total, what

    def __enter__(self):
        if not self.show:
            return lambda n: None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TimeRemainingColumn(), transient=True)
        self._bar.__enter__()
        task = self._bar.add_task(self.what, total=self.total)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.show:
            self._bar.__exit__(*exc)
