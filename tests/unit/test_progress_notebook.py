"""rw.progress in a Jupyter kernel: one working bar per loop, with or without ipywidgets, and
under rw.launch (the workers' bar redrawn as one line by the caller). The kernel is simulated:
an ``IPython`` whose ``get_ipython()`` is a ``ZMQInteractiveShell`` (docs/logging.md)."""

from __future__ import annotations

import sys
import types
import warnings
from typing import ClassVar

import pytest

import rankwise as rw
from rankwise.launch.output import RankLines
from rankwise.launch.spawn import _QueueWriter


def screen(text: str) -> list[str]:
    """What a terminal or a notebook cell shows: each \\r starts the line over, in place."""
    shown = []
    for line in text.split("\n"):
        now = ""
        for piece in line.split("\r"):
            now = piece + now[len(piece) :]
        shown.append(now.rstrip())
    return [s for s in shown if s]


class ZMQInteractiveShell:
    config: ClassVar[dict] = {"IPKernelApp": {}}


@pytest.fixture
def kernel(monkeypatch):
    fake = types.ModuleType("IPython")
    fake.get_ipython = ZMQInteractiveShell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake)
    monkeypatch.delenv("RANKWISE_RANK_PREFIX", raising=False)
    monkeypatch.delenv("RANKWISE_LIVE_BARS", raising=False)


def test_notebook_without_ipywidgets_one_text_bar_redrawn_in_place(kernel, monkeypatch, capsys):
    """Was: tqdm's 'IProgress not found' TqdmWarning and the bar as a new line per refresh."""
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # `import ipywidgets` fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            for i in rw.progress(range(5), desc=f"epoch {epoch}", mininterval=0):
                if i == 2:
                    rw.print0(f"mid-epoch {epoch}")
    assert not [w for w in caught if "IProgress" in str(w.message)], caught
    out = capsys.readouterr().out
    assert out.count("\r") > 4  # it redraws itself ...
    lines = screen(out)
    bars = [ln for ln in lines if ln.startswith("epoch")]
    assert len(bars) == 2, lines  # ... and each loop leaves one bar, finished
    assert "5/5" in bars[0] and "5/5" in bars[1] and bars[0].startswith("epoch 0")
    assert lines.index("mid-epoch 0") < lines.index(bars[0]) < lines.index("mid-epoch 1")


def test_notebook_with_ipywidgets_draws_a_widget_that_stays(monkeypatch, capsys):
    """Was: the widget hidden when the loop ended (no bar at all)."""
    pytest.importorskip("ipywidgets")  # with the real IPython, which ipywidgets imports
    from tqdm.notebook import tqdm as widget_bar

    from rankwise.output import console

    monkeypatch.setattr(console, "in_notebook", lambda: True)
    monkeypatch.delenv("RANKWISE_RANK_PREFIX", raising=False)

    bars = rw.progress(range(3), desc="train")
    assert isinstance(bars.bar, widget_bar)
    for _ in bars:
        pass
    assert bars.bar.n == 3 and bars.bar.leave  # closed, not hidden: the finished bar stays
    assert bars.bar.container.layout.visibility != "hidden"
    assert "IProgress" not in capsys.readouterr().err


class _Queue(list):
    put = list.append


def _worker_bar(queue: _Queue, live: bool, monkeypatch) -> None:
    """What rank 0 of rw.launch sends: its stdout is a _QueueWriter, as in the child."""
    monkeypatch.setenv("RANKWISE_RANK_PREFIX", "1")  # the caller prefixes the lines
    monkeypatch.setenv("RANKWISE_LIVE_BARS", "1" if live else "0")
    writer = _QueueWriter(queue, 0, "stdout")
    monkeypatch.setattr(sys, "stdout", writer)
    monkeypatch.setattr(sys, "stderr", _QueueWriter(queue, 0, "stderr"))
    for i in rw.progress(range(6), desc="epoch 0"):  # the defaults: a real loop's
        if i == 3:
            rw.print0("a print mid-bar")
    writer.flush()
    monkeypatch.undo()


@pytest.mark.parametrize("live", [True, False])
def test_launched_worker_bar_is_one_line_in_the_caller(kernel, monkeypatch, capsys, live):
    """Was: the worker's bar arrived as one '[rank 0] ...' line per refresh (and, in a kernel,
    with tqdm's TqdmWarning)."""
    queue = _Queue()
    _worker_bar(queue, live, monkeypatch)
    assert any(m[0] == "bar" for m in queue) == live  # \r updates only to a caller that redraws
    shown = RankLines(live=live)
    for kind, *message in queue:
        (shown.bar_update if kind == "bar" else shown.line)(*message)
    shown.end()
    lines = screen(capsys.readouterr().out)
    bars = [ln for ln in lines if ln.startswith("[rank 0] epoch 0")]
    assert len(bars) == 1 and "6/6" in bars[0], lines
    assert "[rank 0] a print mid-bar" in lines
    assert all(ln.count("[rank ") == 1 for ln in lines), lines
