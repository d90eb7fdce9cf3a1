"""``rankwise top``: a job's ranks in the terminal, one bar of step anatomy per rank.

Drawn with rich (a ``Live`` display redrawn every ``--interval`` seconds; ``--once`` prints
one frame). Where the output has no colours (a pipe, a file, ``NO_COLOR``), each phase is
drawn with its own letter instead of a coloured block, so a frame reads the same in a log.
"""

from __future__ import annotations

import time
from typing import Any

from .records import PHASES, RunView
from .summary import (
    RankSummary,
    Summary,
    human_age,
    human_bytes,
    straggler_line,
    summarize,
)

STYLE = {
    "data": "cyan", "forward": "green", "backward": "blue", "comm": "magenta",
    "wait": "red", "optimizer": "yellow", "checkpoint": "white", "other": "bright_black",
}
LETTER = {
    "data": "d", "forward": "f", "backward": "b", "comm": "c",
    "wait": "w", "optimizer": "o", "checkpoint": "k", "other": ".",
}
OTHER_COLUMNS = 52
"""Cells the table's other columns take: the bars get the rest of the terminal's width."""


def bar(r: RankSummary, longest: float, width: int, plain: bool) -> Any:
    """A rich ``Text`` of ``width * r.total / longest`` cells, one run of cells per phase
    (rounded on the running sum, so the runs add up to the rank's whole length)."""
    from rich.text import Text

    text = Text()
    done = 0.0
    drawn = 0
    for p in PHASES:
        done += r.phases[p]
        cells = round(width * done / longest) - drawn if longest > 0 else 0
        if cells > 0:
            text.append((LETTER[p] if plain else "\u2588") * cells, style=None if plain else STYLE[p])
            drawn += cells
    return text


def legend(plain: bool) -> Any:
    from rich.text import Text

    text = Text()
    for p in PHASES:
        text.append(LETTER[p] if plain else "\u2588", style=None if plain else STYLE[p])
        text.append(f"={p} " if plain else f" {p}  ")
    text.rstrip()
    return text


def _header(s: Summary) -> str:
    """Short lines: a frame printed into a log is not wrapped mid-phrase."""
    if s.step is None:
        return f"{s.run_dir}: waiting for the first step record"
    speed = []
    if s.steps_per_s is not None:
        speed.append(f"{s.steps_per_s:.2f} steps/s")
    if s.step_s is not None:
        speed.append(f"{s.step_s * 1000:.1f} ms/step")
    if s.age_s is not None:
        speed.append(f"last record {human_age(s.age_s)} ago")
    return f"{s.run_dir}: step {s.step}, {s.strategy or '?'}, {s.world} ranks\n" + ", ".join(speed)


def _table(s: Summary, plain: bool, width: int) -> Any:
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for name, justify in (("rank", "right"), ("node", "right"), ("step anatomy", "left"),
                          ("step ms", "right"), ("wait ms", "right"), ("waits for", "right"),
                          ("memory", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    longest = max((r.total for r in s.ranks), default=0.0)
    culprit = s.straggler.rank if s.straggler else None
    for r in s.ranks:
        table.add_row(
            str(r.rank), str(r.node), bar(r, longest, max(10, width - OTHER_COLUMNS), plain),
            f"{r.total * 1000:.1f}", f"{r.phases['wait'] * 1000:.1f}",
            "-" if r.wait_for is None else str(r.wait_for), human_bytes(r.mem),
            style="bold" if r.rank == culprit else None,
        )
    return table


def frame(s: Summary, plain: bool = False, width: int = 100) -> Any:
    """The whole screen for one summary (a rich renderable)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    parts: list[Any] = [Text(_header(s), style=None if plain else "bold")]
    if s.ranks:
        parts += [_table(s, plain, width), legend(plain)]
    style = "yellow" if s.straggler else "green"
    parts.append(Text(straggler_line(s.straggler), style=None if plain else style))
    if s.hang is not None:
        parts.append(Panel(s.hang.text or "(no diagnosis text)", title="hang",
                           border_style="none" if plain else "red"))
    if s.skipped:
        parts.append(Text(f"{s.skipped} malformed line(s) skipped"))
    return Group(*parts)


def print_once(view: RunView, console: Any, last: int) -> None:
    view.poll()
    plain = console.color_system is None
    # Into a file or a pipe: long lines stay whole (the table still fits the width).
    console.print(frame(summarize(view, last), plain, console.width), soft_wrap=plain)


def watch(view: RunView, console: Any, interval: float, last: int) -> None:
    """Redraw until Ctrl-C."""
    from rich.live import Live

    plain = console.color_system is None
    view.poll()
    def draw() -> Any:
        return frame(summarize(view, last), plain, console.width)

    with Live(draw(), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                view.poll()
                live.update(draw(), refresh=True)
        except KeyboardInterrupt:
            pass
