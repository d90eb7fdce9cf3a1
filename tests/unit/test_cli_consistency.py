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
        (
            ["run", "--nprocs-per-node", "2", "train.py"],
            "rankwise run",
            "--nprocs-per-node",
            "--nproc-per-node",
        ),
        (["bench", "--modle", "cnn"], "rankwise bench", "--modle", "--model"),
        (["bench", "comm", "--sizes=4096"], "rankwise bench comm", "--sizes", None),
        (["check", "--jsn", "x.py"], "rankwise check", "--jsn", "--json"),
        (
            ["doctor", "--nproc-per-nodes", "2"],
            "rankwise doctor",
            "--nproc-per-nodes",
            "--nproc-per-node",
        ),
        (["topology", "--nnode", "2", "--nodes", "3"], "rankwise topology", "--nodes", "--nnodes"),
        (["config", "--max-restart", "2", "--shwo"], "rankwise config", "--shwo", "--show"),
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
    assert (
        last
        == "rankwise topology: error: unrecognized argument --zzzzzz; see rankwise topology --help"
    )


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
    "argv",
    [
        ["run"], ["config"], ["topology"], ["check"], ["doctor"], ["bench"], ["bench", "comm"],
        ["checkpoint", "inspect"], ["checkpoint", "consolidate"],
    ],
)
def test_every_option_has_help_text(argv: list[str]) -> None:
    parser = build_parser()
    for name in argv:  # walk down to the sub-command's parser
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and a.help is None]
    assert missing == [], f"{' '.join(argv)}: options without help: {missing}"


def test_topology_json_into_a_closed_pipe_ends_quietly(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = (
        f"{sys.executable} -m rankwise topology --nnodes 2000 --nproc-per-node 8 --json | head -n 1"
    )
    proc = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout == "{\n"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    # and the whole document is valid JSON when nobody closes the pipe
    full = subprocess.run(
        [sys.executable, "-m", "rankwise", "topology", "--nnodes", "2", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(full.stdout)["nnodes"] == 2


# --- the conventions, checked on every parser: a new flag that breaks one fails here ---------


def _parsers() -> dict[str, object]:
    """Every parser a user meets: each sub-command (and sub-sub-command) and the legacy launcher."""
    import argparse

    from rankwise.launch.__main__ import main as _legacy  # noqa: F401  (import check)

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}")

    walk(build_parser(), "rankwise")
    from rankwise.cli_args import Parser
    from rankwise.launch.cli import add_launch_arguments

    legacy = Parser(prog="python -m rankwise.launch")
    add_launch_arguments(legacy)
    found["python -m rankwise.launch"] = legacy
    return found


def _options(parser) -> list:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_long_flag_has_both_spellings() -> None:
    missing = []
    for name, parser in _parsers().items():
        for action in _options(parser):
            strings = set(action.option_strings)
            for s in action.option_strings:
                if not s.startswith("--"):
                    continue
                twin = (
                    "--" + s[2:].replace("-", "_")
                    if "-" in s[2:]
                    else "--" + s[2:].replace("_", "-")
                )
                if twin not in strings:
                    missing.append(f"{name}: {s} without {twin}")
    assert missing == []


_TOKEN = r"(?:[A-Z][A-Z0-9]*|[a-z][a-z0-9-]*|\.\.\.)"
_METAVAR = rf"^{_TOKEN}(?:[|:,=]{_TOKEN})*$"


def test_one_metavar_style() -> None:
    """Explicit, CAPITALS for what the user fills in, literals for fixed words: ``N|auto``."""
    import argparse
    import re

    bad = []
    for name, parser in _parsers().items():
        for action in parser._actions:
            if action.nargs == 0 or action.dest in ("help", "version"):
                continue  # a switch takes no value
            mv = action.metavar
            label = action.option_strings[0] if action.option_strings else action.dest
            if not isinstance(mv, str) or not re.match(_METAVAR, mv):
                bad.append(f"{name} {label}: metavar {mv!r}")
            elif not re.search(r"[A-Z]", mv) and not action.choices:
                bad.append(f"{name} {label}: metavar {mv!r} names no value (CAPITALS) nor choices")
            elif (
                action.choices
                and not isinstance(action, argparse._SubParsersAction)
                and (mv != "|".join(map(str, action.choices)))
            ):
                bad.append(f"{name} {label}: choices {list(action.choices)} but metavar {mv!r}")
    assert bad == []


def test_one_name_per_concept() -> None:
    """A flag means one thing everywhere: one dest per flag, one primary name per dest."""
    dest_of: dict[str, str] = {}
    primary_of: dict[str, str] = {}
    clashes = []
    for name, parser in _parsers().items():
        for action in _options(parser):
            if action.dest == "version":
                continue
            for s in action.option_strings:
                if dest_of.setdefault(s, action.dest) != action.dest:
                    clashes.append(f"{name}: {s} fills {action.dest}, elsewhere {dest_of[s]}")
            first = action.option_strings[0]
            if primary_of.setdefault(action.dest, first) != first:
                clashes.append(
                    f"{name}: {action.dest} is {first}, elsewhere {primary_of[action.dest]}"
                )
    assert clashes == []
    # the processes-per-node concept is --nproc-per-node wherever it appears
    for name, parser in _parsers().items():
        for action in _options(parser):
            if any(s.startswith("--nproc") for s in action.option_strings):
                assert action.option_strings[0] == "--nproc-per-node", name


def test_json_wherever_a_table_is_printed() -> None:
    tables = {
        "rankwise config",
        "rankwise topology",
        "rankwise check",
        "rankwise doctor",
        "rankwise bench",
        "rankwise bench comm",
        "rankwise checkpoint inspect",
    }
    parsers = _parsers()
    assert tables <= set(parsers)
    no_json = [n for n in sorted(tables) if "--json" not in parsers[n]._option_string_actions]
    assert no_json == []


@pytest.mark.parametrize(
    ("argv", "closest"),
    [
        (["runn"], "run"),
        (["topolgy"], "topology"),
        (["bench", "comn"], "comm"),
        (["checkpoint", "inspct"], "inspect"),
        (["bench", "--device", "cdua"], "cuda"),
    ],
)
def test_mistyped_command_or_choice_names_the_closest(argv, closest, capsys) -> None:
    last = _usage_error(argv, capsys).strip().splitlines()[-1]
    assert f"did you mean {closest!r}?" in last, last
    assert repr(argv[-1]) in last


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--nproc", "3"],
        ["bench", "--nproc-per-node", "3"],
        ["bench", "--nproc_per_node=3"],
        ["bench", "comm", "--nproc", "3"],
        ["bench", "comm", "--nproc-per-node", "3"],
    ],
)
def test_bench_takes_nproc_per_node_and_the_old_nproc(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).nproc_per_node == 3


@pytest.mark.parametrize("spelling", ["--comm-max-bytes", "--max-bytes", "--max_bytes"])
@pytest.mark.parametrize("command", [["bench"], ["bench", "comm"]])
def test_one_max_bytes_flag_for_bench_and_bench_comm(command, spelling) -> None:
    assert build_parser().parse_args([*command, spelling, "65536"]).comm_max_bytes == 65536


def test_doctor_node_rank(capsys) -> None:
    assert build_parser().parse_args(["doctor", "--node_rank", "1"]).node_rank == 1
    code = main(["doctor", "--nnodes", "2", "--node-rank", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    port = [f for f in out["findings"] if f["check"] == "port"]
    assert port[0]["message"] == "--node-rank 2 is out of range for --nnodes 2"


def test_check_list_rules_as_json(capsys) -> None:
    assert main(["check", "--list-rules", "--json"]) == 0
    rules = json.loads(capsys.readouterr().out)
    assert {"id", "severity", "slug", "summary"} <= set(rules[0])
    assert len({r["id"] for r in rules}) == len(rules) > 10


def test_the_two_launchers_name_each_other() -> None:
    import rankwise as rw
    from rankwise.errors import ConfigError
    from rankwise.launch import LaunchOptions, launch

    def train() -> None: ...

    with pytest.raises(ConfigError) as exc:
        launch(train)
    assert "rw.launch(train, nprocs=2)" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        rw.launch(LaunchOptions(script="train.py", nproc_per_node=2))
    assert "rankwise.launch.launch(LaunchOptions(script='train.py'" in str(exc.value)
    assert "rankwise run --nproc-per-node 2 train.py" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        rw.launch("train.py", nprocs=2)
    assert "not a script" in str(exc.value)
