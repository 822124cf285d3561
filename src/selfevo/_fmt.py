"""Numbers as table cells: one format for every table, and one mark for "no number"."""

from __future__ import annotations

DASH = "–"  # a metric that is undefined (nothing resolved, one seed has no interval): never 0, never NaN


def num(x: float | None, spec: str = ".3f") -> str:
    """`x` formatted with `spec` (".3f", "+.3f", "+.0%"), or the dash when there is no number."""
    return DASH if x is None else format(x, spec)


def shown(x: float) -> float:
    """`x` as `num` prints it (3 decimals): a change the printed numbers do not show is not claimed."""
    return round(x, 3)


def mean_std_text(cell: dict | None, spec: str = ".3f", n: int | None = None) -> str:
    """A summary over seeds (`algos.summary`'s mean and std) as "mean ± std", or the dash; one seed
    has no spread to show (its std of 0.0 would read as seeds that agree). `n`: the seed count where
    the cell does not carry it (a replay condition keeps it beside its cells)."""
    if not cell or cell.get("mean") is None:
        return DASH
    n = cell.get("n") if n is None else n
    std = DASH if n == 1 or cell.get("std") is None else format(cell["std"], spec)
    return f"{format(cell['mean'], spec)} ± {std}"


def size_text(n: int) -> str:
    """A byte count for people: "512 B", "34.2 KiB", "516.5 MiB", "13.1 GiB"."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}"
