"""`rankwise check` on the corpus: each bad script yields exactly its rule, good ones nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rankwise.check import RULES, check_file

CORPUS = Path(__file__).resolve().parents[1] / "check_corpus"
# A folder holds a script (train.py) and the modules it imports (clean on their own): the
# cross-file cases, where a guard in train.py meets a collective in the other file.
BAD = sorted((CORPUS / "bad").glob("*.py")) + sorted((CORPUS / "bad").glob("*/train.py"))
GOOD = sorted((CORPUS / "good").rglob("*.py")) + sorted(
    p for p in (CORPUS / "bad").glob("*/*.py") if p.name != "train.py"
)
EXPECT = re.compile(r"#\s*expect:\s*(RW\d{3})")


def expected(path: Path) -> list[tuple[str, int]]:
    """The hand-written `# expect: RWnnn` markers of a corpus script, as (rule, line)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(m.group(1), i) for i, line in enumerate(lines, 1) for m in EXPECT.finditer(line)]


@pytest.mark.parametrize("path", BAD, ids=lambda p: str(p.relative_to(CORPUS)))
def test_bad_script_yields_exactly_its_rule(path: Path) -> None:
    want = expected(path)
    assert want, f"{path.name} must mark its line with '# expect: RWnnn'"
    result = check_file(path)
    assert result.error is None
    assert [(f.rule, f.line) for f in result.findings] == want


@pytest.mark.parametrize("path", GOOD, ids=lambda p: str(p.relative_to(CORPUS)))
def test_good_script_yields_nothing(path: Path) -> None:
    result = check_file(path)
    assert result.error is None
    assert [(f.rule, f.line, f.message) for f in result.findings] == []


def test_every_rule_has_a_bad_script() -> None:
    covered = {rule for path in BAD for rule, _ in expected(path)}
    assert covered == {r.id for r in RULES}


# The classic snippets of docs/pitfalls.md, one per pitfall, pinned by file, rule and line.
PITFALLS = {
    "pitfall_ddp_local_rank.py": ("RW010", 14),  # docs/pitfalls.md#pitfall-local-rank: --local_rank only
    "pitfall_cpu_model_wrap.py": ("RW001", 14),  # pitfall 1: DDP on a CPU model
    "pitfall_init_twice.py": ("RW002", 12),  # pitfall 2: init_process_group twice
    "pitfall_sampler_shuffle.py": ("RW003", 14),  # pitfall 3: DistributedSampler + shuffle
    "pitfall_dp_batch_divided.py": ("RW012", 13),  # pitfall 4: DP batch size
    # pitfall 5: net.state_dict() of a DDP net (and, under `if local_rank == 0`, once per node)
    "pitfall_wrapped_state_dict.py": [("RW006", 15), ("RW015", 15)],
    "pitfall_print_all_ranks.py": ("RW007", 8),  # pitfall 6: print on every rank
}


@pytest.mark.parametrize("name", PITFALLS)
def test_pitfall_snippets(name: str) -> None:
    findings = check_file(CORPUS / "bad" / name).findings
    want = PITFALLS[name] if isinstance(PITFALLS[name], list) else [PITFALLS[name]]
    assert [(f.rule, f.line) for f in findings] == want


def test_messages_repeat_the_scripts_own_names_and_lines() -> None:
    (wrap,) = check_file(CORPUS / "bad" / "ddp_moved_after_wrap.py").findings
    assert wrap.message.startswith(
        "`nn.parallel.DistributedDataParallel` wraps `net` at line 12, but the model reaches "
        "its device only later (line 13: `ddp_net.to(device)`)."
    )
    (twice,) = check_file(CORPUS / "bad" / "init_via_setup_twice.py").findings
    assert twice.message.startswith(
        "init_process_group is called again here (through `setup()`, line 6); it already ran "
        "at line 10."
    )
    (hang,) = check_file(CORPUS / "bad" / "collective_after_early_return.py").findings
    assert "only rank 0 reach it (`if rank != 0` at line 7)" in hang.message
