"""`rankwise check` as a command: text and JSON output, the JSON schema, exit statuses."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rankwise.check.cli import main, register

CORPUS = Path(__file__).resolve().parents[1] / "check_corpus"
WRAP = str(CORPUS / "bad" / "pitfall_cpu_model_wrap.py")  # one error, RW001 at 14:9
PRINTS = str(CORPUS / "bad" / "pitfall_print_all_ranks.py")  # one warning, RW007 at 8:5
CLEAN = str(CORPUS / "good" / "clean_torch_ddp.py")

FINDING_KEYS = {"path", "line", "column", "rule", "slug", "severity", "message", "fix"}


def test_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([WRAP]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        f"{WRAP}:14:9: RW001 error [ddp-before-device] `DDP` wraps `model` at line 14, and the "
        "model is never moved to a device before that"
    )
    assert lines[1].startswith("    fix: Move the model to its device first")
    assert lines[-1] == "Found 1 error and 0 warnings in 1 file."


def test_json_report_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", WRAP, PRINTS, CLEAN]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"schema", "files", "summary"}
    assert doc["schema"] == "rankwise.check/1"
    assert doc["summary"] == {"files": 3, "errors": 1, "warnings": 1, "unreadable": 0}
    assert [f["path"] for f in doc["files"]] == [WRAP, PRINTS, CLEAN]
    for entry in doc["files"]:
        assert set(entry) == {"path", "error", "findings"}
        assert entry["error"] is None
        for finding in entry["findings"]:
            assert set(finding) == FINDING_KEYS
            assert isinstance(finding["line"], int) and isinstance(finding["column"], int)
            assert finding["message"] and finding["fix"]
    wrap, prints, clean = (entry["findings"] for entry in doc["files"])
    assert [(f["rule"], f["slug"], f["severity"], f["line"], f["column"]) for f in wrap] == [
        ("RW001", "ddp-before-device", "error", 14, 9)
    ]
    assert [(f["rule"], f["severity"], f["line"], f["column"]) for f in prints] == [
        ("RW007", "warning", 8, 5)
    ]
    assert clean == []


def test_exit_statuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([CLEAN]) == 0
    assert main([PRINTS]) == 0  # warnings alone pass...
    assert main(["--strict", PRINTS]) == 1  # ...unless --strict
    assert main([WRAP]) == 1
    assert main(["--ignore", "RW001", WRAP]) == 0
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    assert main([str(broken), CLEAN]) == 2
    assert main([str(tmp_path / "missing.py")]) == 2
    out = capsys.readouterr().out
    assert f"{broken}: cannot check: SyntaxError: " in out
    assert f"{tmp_path / 'missing.py'}: cannot check: FileNotFoundError" in out
    assert main(["--select", "RW999", CLEAN]) == 2
    assert "--select got unknown rule 'RW999'" in capsys.readouterr().err
    assert main([]) == 2


def test_directory_is_checked_recursively(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", str(CORPUS / "good")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["files"] == len(list((CORPUS / "good").rglob("*.py")))
    assert doc["summary"]["errors"] == doc["summary"]["warnings"] == 0


def test_register_adds_the_check_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="rankwise")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["check", "--json", WRAP])
    assert args.command == "check"
    assert args.func(args) == 1
    assert json.loads(capsys.readouterr().out)["summary"]["errors"] == 1


def test_list_rules(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list-rules"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 24  # RW001..RW024
    assert out[0].split()[:3] == ["RW001", "error", "ddp-before-device"]
