"""Run the corpus of mistakes (tests/mistakes/*.py) and say how loud each one is.

Each script is a mistake someone asked about (its first line cites the thread) and declares the
loud outcome it must produce, in its header:

    # https://discuss.pytorch.org/t/...             the question it comes from
    # mistake: accuracy from .item() printed on rank 0 as the job's
    # expect: check RW020                           rules `rankwise check` must report
    # expect-run: fact | fact ; fix: word | word    what `rankwise run --nproc-per-node 2` must say
    # wrong: uneven data | join()                   advice that would be wrong here
    # depends: metrics                              the run-time side is another branch's feature

A script is *right* when every expectation holds (the rules found, each fact and each fix word
in the run's output), *wrong* when a wrong piece of advice appears (a `wrong:` phrase in the
output, or a `wrong-check:` rule), *silent* when an expectation is missing, and *hang* when the
run was still going at the guard timeout without its expected report (a stall report that says
the right thing before the guard counts as loud: the job would still fail at its own timeout).

    python tools/mistakes.py              run everything, print one line per script and the figure
    python tools/mistakes.py --table      print the docs/pitfalls.md table generated from headers
    python tools/mistakes.py --write-docs rewrite that table in docs/pitfalls.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "mistakes"
PITFALLS = ROOT / "docs" / "pitfalls.md"
START, END = "<!-- mistakes-corpus:start -->", "<!-- mistakes-corpus:end -->"
GUARD_S = 90.0
"""A run still going after this long, without its expected report, is a hang."""
STALL_S = "4"
"""RANKWISE_STALL_REPORT_S for the runs: a hang is reported after 4 s instead of 50 s."""
VERDICTS = ("right", "wrong", "silent", "hang")


@dataclass(frozen=True)
class Mistake:
    """One corpus script and what it must produce."""

    path: Path
    source: str
    mistake: str
    rules: tuple[str, ...]
    facts: tuple[str, ...]
    fixes: tuple[str, ...]
    wrong: tuple[str, ...]
    wrong_rules: tuple[str, ...]
    depends: str | None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def runs(self) -> bool:
        return bool(self.facts or self.fixes)


def _parts(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split("|") if p.strip())


def parse(path: Path) -> Mistake:
    """The header of one corpus script (refuses a script without a source or an expectation)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    first = lines[0] if lines else ""
    if not re.match(r"#\s*https?://\S+$", first):
        raise ValueError(f"{path.name}: the first line must be '# <url of the question>'")
    head: dict[str, str] = {}
    for line in lines[1:]:
        m = re.match(r"#\s*(mistake|expect|expect-run|wrong|wrong-check|depends|env):\s*(.*)$",
                     line)  # fmt: skip
        if m:
            head[m.group(1)] = m.group(2).strip()
    run = head.get("expect-run", "")
    facts, _, fixes = run.partition(";")
    fixes = fixes.strip().removeprefix("fix:")
    env = dict(kv.split("=", 1) for kv in head.get("env", "").split() if "=" in kv)
    m = Mistake(
        path=path, source=first.lstrip("# ").strip(), mistake=head.get("mistake", ""),
        rules=tuple(re.findall(r"RW\d{3}", head.get("expect", ""))), facts=_parts(facts),
        fixes=_parts(fixes), wrong=_parts(head.get("wrong", "")),
        wrong_rules=tuple(re.findall(r"RW\d{3}", head.get("wrong-check", ""))),
        depends=head.get("depends") or None, env=env,
    )  # fmt: skip
    if not m.mistake or not (m.rules or m.runs):
        raise ValueError(f"{path.name}: needs '# mistake:' and '# expect:' or '# expect-run:'")
    return m


def corpus() -> list[Mistake]:
    return [parse(p) for p in sorted(CORPUS.glob("m*.py"))]


def check_verdict(m: Mistake) -> tuple[str, str]:
    """``rankwise check``'s side: the expected rules found, and no wrong one."""
    if not m.rules and not m.wrong_rules:
        return "right", ""
    from rankwise.check import check_file

    found = check_file(m.path).findings
    ids = {f.rule for f in found}
    if ids & set(m.wrong_rules):
        return "wrong", f"check reported {sorted(ids & set(m.wrong_rules))}"
    missing = [r for r in m.rules if r not in ids]
    if missing:
        return "silent", f"check did not report {missing} (found {sorted(ids)})"
    return "right", ", ".join(sorted(ids))


def _has(text: str, words: tuple[str, ...]) -> bool:
    low = text.lower()
    return all(w.lower() in low for w in words)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_verdict(
    m: Mistake, workdir: Path, output: list[str] | None = None
) -> tuple[str, str, float]:
    """The launcher's side: run the script on 2 processes and read what it says (appended to
    ``output`` when given)."""
    if not m.runs:
        return "right", "", 0.0
    env = {**os.environ, "RANKWISE_STALL_REPORT_S": STALL_S, "PYTHONUNBUFFERED": "1", **m.env}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "") if src not in env.get(
        "PYTHONPATH", "") else env["PYTHONPATH"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", str(m.path)],
        cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    satisfied_at = None
    while True:
        text = "".join(out)
        if satisfied_at is None and _has(text, m.facts) and _has(text, m.fixes):
            satisfied_at = time.monotonic()
        if proc.poll() is not None:
            break
        if satisfied_at is not None and time.monotonic() - satisfied_at > 3.0:
            break  # reported right; a hanging job would only fail later at its own timeout
        if time.monotonic() - start > GUARD_S:
            break
        time.sleep(0.2)
    ended = proc.poll() is not None
    if not ended:
        _kill(proc)
    reader.join(timeout=5)
    text, took = "".join(out), time.monotonic() - start
    if output is not None:
        output.append(text)
    low = text.lower()
    bad = [w for w in m.wrong if w.lower() in low]
    if bad:
        return "wrong", f"the output gives the wrong advice {bad}", took
    if satisfied_at is not None:
        return "right", "", took
    if not ended:
        return "hang", f"still running after {GUARD_S:.0f}s without its report", took
    facts = "found" if _has(text, m.facts) else "missing"
    return "silent", f"facts {facts}, fix words missing; output tail: {text[-600:]!r}", took


def verdict(m: Mistake, workdir: Path, run: bool = True) -> tuple[str, str, float]:
    """The script's verdict: the worse of its check side and its run side."""
    c, cwhy = check_verdict(m)
    r, rwhy, took = run_verdict(m, workdir) if run else ("right", "", 0.0)
    worst = max((c, r), key=lambda v: ("right", "silent", "wrong", "hang").index(v))
    return worst, "; ".join(w for w in (cwhy if c != "right" else "", rwhy) if w), took


def figure(verdicts: dict[str, str]) -> str:
    n = len(verdicts)
    count = {v: sum(1 for x in verdicts.values() if x == v) for v in VERDICTS}
    share = 100.0 * count["right"] / n if n else 0.0
    return (
        f"mistakes corpus: {n} scripts: loud with the right fix {count['right']} ({share:.0f}%), "
        f"loud with a wrong fix {count['wrong']}, silent {count['silent']}, hang {count['hang']}"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _where(url: str) -> str:
    """'pytorch/pytorch#46821' for a GitHub thread, the site's name otherwise."""
    gh = re.match(r"https?://github\.com/([^/]+/[^/]+)/(?:issues|pull)/(\d+)", url)
    if gh:
        return f"{gh.group(1)}#{gh.group(2)}"
    return re.sub(r"^https?://(www\.)?", "", url).split("/")[0]


def table(mistakes: list[Mistake]) -> str:
    """The docs/pitfalls.md table, from the scripts' headers alone."""
    rows = [
        "| # | mistake | asked at | `rankwise check` | run time (what the message names; the fix) |",
        "|---|---|---|---|---|",
    ]
    for i, m in enumerate(mistakes, 1):
        run = ""
        if m.runs:
            run = f"{', '.join(m.facts)}; fix: {', '.join(m.fixes)}"
        if m.depends:
            run = (run + " " if run else "") + f"(run-time side: the `{m.depends}` branch)"
        where = _where(m.source)
        rows.append(
            f"| {i} | {_cell(m.mistake)} ([`{m.path.name}`](../tests/mistakes/{m.path.name})) "
            f"| [{where}]({m.source}) | {', '.join(m.rules) or '-'} | {_cell(run) or '-'} |"
        )
    return "\n".join(rows)


def page_with_table(page: str, mistakes: list[Mistake]) -> str:
    if START not in page or END not in page:
        raise ValueError(f"{PITFALLS} has no {START} ... {END} block")
    head, _, rest = page.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{table(mistakes)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", action="store_true", help="print the generated table")
    p.add_argument("--write-docs", action="store_true", help="rewrite docs/pitfalls.md's table")
    p.add_argument("--check-only", action="store_true", help="skip the launcher runs")
    p.add_argument("-k", default="", help="only scripts whose name contains this")
    a = p.parse_args(argv)
    mistakes = [m for m in corpus() if a.k in m.path.name]
    if a.table:
        print(table(mistakes))
        return 0
    if a.write_docs:
        PITFALLS.write_text(page_with_table(PITFALLS.read_text(), corpus()))
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    verdicts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in mistakes:
            work = Path(tmp) / m.path.stem
            work.mkdir()
            v, why, took = verdict(m, work, run=not a.check_only)
            verdicts[m.path.name] = v
            print(f"{v:<6} {took:5.1f}s {m.path.name} {why}", flush=True)
    print(figure(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
