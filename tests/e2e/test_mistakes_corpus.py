"""The corpus of mistakes from real questions (tests/mistakes/, issue 43 item 1): each script runs
under `rankwise run --nproc-per-node 2` where its outcome is at run time, and through
`rankwise check`; at least 90% must be loud with the right fix, none with a wrong fix, none may
hang past its stall report. docs/pitfalls.md's table is generated from the scripts' headers.

The harness is tools/mistakes.py (`python tools/mistakes.py` prints the figure by hand)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("rw_mistakes", ROOT / "tools" / "mistakes.py")
mistakes = importlib.util.module_from_spec(_spec)
sys.modules["rw_mistakes"] = mistakes  # dataclasses look their module up by name
_spec.loader.exec_module(mistakes)

CORPUS = mistakes.corpus()
SOURCES = re.compile(
    r"https://(discuss\.pytorch\.org/t/|stackoverflow\.com/questions/|github\.com/[\w.-]+/[\w.-]+/"
    r"(issues|pull)/)"
)


def test_the_corpus_has_forty_cited_mistakes_each_with_an_outcome():
    assert len(CORPUS) >= 40
    for m in CORPUS:
        assert SOURCES.match(m.source), f"{m.path.name} cites {m.source}"
        assert m.rules or m.runs, m.path.name
        assert not (m.depends and not m.rules), f"{m.path.name}: loud through check at least"
    assert len({m.source for m in CORPUS}) >= len(CORPUS) - 3  # distinct questions, mostly


def test_the_pitfalls_table_is_generated_from_the_corpus():
    page = mistakes.PITFALLS.read_text(encoding="utf-8")
    assert page == mistakes.page_with_table(page, CORPUS), (
        "docs/pitfalls.md's corpus table differs from tests/mistakes/: run "
        "`python tools/mistakes.py --write-docs`"
    )


def test_a_header_without_source_or_outcome_is_refused(tmp_path):
    bad = tmp_path / "m99_x.py"
    bad.write_text("# mistake: no source\n# expect: check RW001\n")
    with pytest.raises(ValueError, match="first line"):
        mistakes.parse(bad)
    bad.write_text("# https://github.com/o/r/issues/1\n# mistake: nothing expected\n")
    with pytest.raises(ValueError, match="expect"):
        mistakes.parse(bad)


def test_the_harness_tells_right_wrong_silent_and_hang_apart(tmp_path):
    """The classifier on scripts whose outcome is known without rankwise's help."""
    cases = {
        "right": "print('boom: the value 7 ; use the fix')",
        "wrong": "print('boom: the value 7, pad the data')",
        "silent": "print('all good')",
        "hang": "import time; time.sleep(600)",
    }
    head = "# https://github.com/o/r/issues/1\n# mistake: x\n"
    head += "# expect-run: value 7 ; fix: the fix\n# wrong: pad the data\n"
    old = mistakes.GUARD_S
    mistakes.GUARD_S = 20.0
    try:
        for want, body in cases.items():
            path = tmp_path / f"m_{want}.py"
            path.write_text(head + body + "\n")
            work = tmp_path / want
            work.mkdir()
            got, why, _ = mistakes.run_verdict(mistakes.parse(path), work)
            assert got == want, (want, why)
    finally:
        mistakes.GUARD_S = old


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 13 launcher runs: ~3 min on 2 quiet cores, more when loaded
def test_the_corpus_is_loud_with_the_right_fix(tmp_path, capsys):
    verdicts, reasons = {}, {}
    for m in CORPUS:
        work = tmp_path / m.path.stem
        work.mkdir()
        verdicts[m.path.name], reasons[m.path.name], _ = mistakes.verdict(m, work)
    figure = mistakes.figure(verdicts)
    with capsys.disabled():
        print("\n" + figure)
        for name, v in verdicts.items():
            if v != "right":
                print(f"  {v}: {name}: {reasons[name][:300]}")
    count = {v: list(verdicts.values()).count(v) for v in mistakes.VERDICTS}
    assert count["wrong"] == 0, reasons
    assert count["hang"] == 0, reasons
    assert count["right"] >= 0.9 * len(CORPUS), figure


@pytest.mark.slow
def test_a_rank_guarded_zero_collective_is_reported_before_the_stall_delay(tmp_path):
    """Item 4: `torch.save(opt.state_dict())` under `if rank == 0:` under zero2 hangs; with the
    stall delay at 120 s, the report still comes after GUARDED_SHARDED_S and names it right."""
    (m,) = [m for m in CORPUS if m.path.name.startswith("m04_")]
    m = dataclasses.replace(m, env={"RANKWISE_STALL_REPORT_S": "120"})
    out: list[str] = []
    verdict, why, _ = mistakes.run_verdict(m, tmp_path, out)
    assert verdict == "right", why
    waited = re.search(r"have been waiting in for (\d+)s", out[0])
    assert waited and int(waited.group(1)) < 120, out[0][-2000:]
    assert "optimizer's state_dict() on some ranks only" in out[0]
