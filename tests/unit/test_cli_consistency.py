"""The ``rankwise`` command's sub-commands behave alike: usage errors, spellings, help, pipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rankwise.cli import build_parser, main


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "prog", "unknown", "closest"),
    [
        (["run", "--nprocs-per-node", "2", "train.py"], "rankwise run", "--nprocs-per-node",
         "--nproc-per-node"),
        (["bench", "--modle", "cnn"], "rankwise bench", "--modle", "--model"),
        (["bench", "comm", "--sizes=4096"], "rankwise bench comm", "--sizes", None),
        (["check", "--jsn", "x.py"], "rankwise check", "--jsn", "--json"),
        (["doctor", "--nproc-per-nodes", "2"], "rankwise doctor", "--nproc-per-nodes",
         "--nproc-per-node"),
        (["topology", "--nnode", "2", "--nodes", "3"], "rankwise topology", "--nodes", "--nnodes"),
    ],
)
def test_unknown_flag_names_the_subcommand_and_the_closest_flag(
    argv: list[str], prog: str, unknown: str, closest: str | None, capsys
) -> None:
    err = _usage_error(argv, capsys)
    assert err.startswith(f"usage: {prog} "), err  # the sub-command's usage, not rankwise's
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: unrecognized argument {unknown}"), last
    if closest:
        assert last.endswith(f"(did you mean {closest}?)"), last
    assert "invalid choice" not in err


def test_a_far_off_flag_points_at_help(capsys) -> None:
    last = _usage_error(["topology", "--zzzzzz"], capsys).strip().splitlines()[-1]
    assert last == "rankwise topology: error: unrecognized argument --zzzzzz; see rankwise topology --help"


@pytest.mark.parametrize("spelling", ["--nproc-per-node", "--nproc_per_node"])
@pytest.mark.parametrize("command", ["run", "topology", "doctor"])
def test_torchrun_spellings_accepted_everywhere(command: str, spelling: str) -> None:
    argv = [command, spelling, "3", "--nnodes", "2"] + (["train.py"] if command == "run" else [])
    args = build_parser().parse_args(argv)
    assert (args.nproc_per_node, args.nnodes) == (("3", "2") if command == "run" else (3, 2))


@pytest.mark.parametrize("value", ["-1", "0", "two"])
def test_doctor_rejects_counts_below_one(value: str, capsys) -> None:
    last = _usage_error(["doctor", "--nproc-per-node", value], capsys).strip().splitlines()[-1]
    assert last.startswith("rankwise doctor: error: argument --nproc-per-node/--nproc_per_node: ")
    assert repr(value) in last or value in last


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_doctor_help_is_for_users(capsys) -> None:
    text = _help(["doctor"], capsys)
    assert "``" not in text and "python -m" not in text  # no developer docstring
    assert "rankwise doctor --nproc-per-node 4" in text
    assert "Exit status" in text


@pytest.mark.parametrize(
    "argv", [["run"], ["topology"], ["check"], ["doctor"], ["bench"], ["bench", "comm"]]
)
def test_every_option_has_help_text(argv: list[str]) -> None:
    parser = build_parser()
    for name in argv:  # walk down to the sub-command's parser
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    missing = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.help is None
    ]
    assert missing == [], f"{' '.join(argv)}: options without help: {missing}"


def test_topology_json_into_a_closed_pipe_ends_quietly(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = (
        f"{sys.executable} -m rankwise topology --nnodes 2000 --nproc-per-node 8 --json "
        "| head -n 1"
    )
    proc = subprocess.run(
        ["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout == "{\n"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    # and the whole document is valid JSON when nobody closes the pipe
    full = subprocess.run(
        [sys.executable, "-m", "rankwise", "topology", "--nnodes", "2", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert json.loads(full.stdout)["nnodes"] == 2
