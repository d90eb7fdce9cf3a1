"""Rank-0 output: bars as whole lines when not on a terminal, prints and log lines above a bar
drawn in place, one rank prefix under the launcher (docs/launcher.md)."""

from __future__ import annotations

import io
import logging
import sys

import rankwise as rw


class _Terminal(io.StringIO):
    """One screen that stdout and stderr share, as in an interactive shell."""

    def isatty(self) -> bool:
        return True


def test_not_a_terminal_bars_are_whole_lines_in_order_with_prints(capsys):
    for epoch in range(2):
        for _ in rw.progress(range(4), desc=f"epoch {epoch}", mininterval=0, delay=0):
            pass
        rw.print0(f"epoch {epoch} done")
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = out.splitlines()
    assert all(line.strip() for line in lines), lines  # no blank lines
    done = [i for i, line in enumerate(lines) if line.endswith("done")]
    bars = [i for i, line in enumerate(lines) if "4/4" in line]
    assert len(done) == 2 and len(bars) == 2  # each pass ends in one final line, not repeated
    assert bars[0] < done[0] < bars[1] < done[1]


def test_a_short_pass_still_gets_its_final_line(capsys):
    for _ in rw.progress(range(3), desc="short"):  # the default delay: nothing before the end
        pass
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "short" in lines[0] and "3/3" in lines[0]


def test_on_a_terminal_prints_and_log_lines_go_above_the_bar(monkeypatch):
    screen = _Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    log = rw.get_logger("rankwise.test_terminal")
    for i in rw.progress(range(3), desc="train", mininterval=0):
        if i == 1:
            rw.print0("printed mid-bar")
            log.info("logged mid-bar")
    text = screen.getvalue()
    for message in ("printed mid-bar", "logged mid-bar"):
        # What precedes the message on its screen line (after the last \r or \n) is blank:
        # the bar was cleared first, so the message does not run on from the bar.
        before = text[: text.index(message)]
        on_line = before[max(before.rfind("\r"), before.rfind("\n")) + 1 :]
        assert on_line.strip() in ("", "[rank 0/1]"), on_line
    assert "3/3" in text.split("logged mid-bar")[-1]  # and the bar was drawn again below


def test_logger_leaves_its_prefix_to_the_launcher(monkeypatch, capsys):
    monkeypatch.setenv("RANKWISE_RANK_PREFIX", "1")
    rw.get_logger("rankwise.test_prefix").info("once")
    assert capsys.readouterr().err == "once\n"
    monkeypatch.setenv("RANKWISE_RANK_PREFIX", "0")
    rw.get_logger("rankwise.test_prefix").info("twice")
    assert capsys.readouterr().err == "[rank 0/1] twice\n"
    logging.getLogger("rankwise.test_prefix").handlers.clear()


def test_task_bar_reports_units_of_work_as_lines_on_stderr(capsys):
    from rankwise.output.log import task_bar

    bar = task_bar(3, "rankwise bench", unit="run")
    for name in ("single", "ddp", "dp"):
        bar.update(f"timing {name}")
    bar.close()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 1  # a quick job: one line, the final one
    assert lines[0].startswith("rankwise bench: 100%") and "3/3" in lines[0]
    assert "timing dp" in lines[0]
