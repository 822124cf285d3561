"""The progress display of long index work (encoding passages, indexing a corpus)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from selfevo.corpus import count_lines

T = TypeVar("T")


def corpus_total(path: str | os.PathLike, show: bool) -> int | None:
    """The total of a build's bar over the corpus file `path`: its lines, counted (no parse) only
    when the bar is shown; none (the bar counts) for a gzipped corpus (`count_lines`)."""
    return count_lines(path) if show else None


def ticked(items: Iterable[T], advance: Callable[[int], None], every: int = 10_000) -> Iterator[T]:
    """`items` passed through, the bar advanced every `every` of them: a bar told of each of 21M
    passages would cost more than the work it shows."""
    for i, item in enumerate(items, start=1):
        if i % every == 0:
            advance(every)
        yield item


class ProgressBar:
    """A rich progress bar (or nothing) that yields an `advance(n)` callable (`total` None: a count)."""

    def __init__(self, show: bool, total: int | None, what: str):
        self.show, self.total, self.what = show, total, what

    def __enter__(self):
        if not self.show:
            return lambda n: None
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        from selfevo._bar import Progress

        # descriptions name models and files the user gave: text, never rich markup ("[/x]" would raise)
        self._bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TimeRemainingColumn(), transient=True)
        self._bar.__enter__()
        task = self._bar.add_task(self.what, total=self.total)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.show:
            self._bar.__exit__(*exc)
