"""``rankwise.toml`` / ``[tool.rankwise]``: read by ``rankwise run`` under its command line,
written by ``rankwise config`` (questions on stdin, or flags), shown by ``rankwise config --show``."""

from __future__ import annotations

import io
import json
import sys

import pytest

from rankwise.cli import build_parser, main
from rankwise.errors import ConfigError
from rankwise.launch.cli import options_from_args
from rankwise.launch.config.settings import to_toml, tomllib  # tomllib, or tomli on 3.10


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _options(*argv: str):
    return options_from_args(build_parser().parse_args(["run", *argv, "train.py"]))


def test_run_takes_the_file_and_the_command_line_wins(here):
    (here / "rankwise.toml").write_text(
        'nproc-per-node = 3\nmax_restarts = 2\nrdzv-timeout = 60\nlog-dir = "logs"\ndebug = true\n'
    )
    opts = _options()
    assert (opts.nproc_per_node, opts.max_restarts, opts.rdzv_timeout) == (3, 2, 60)
    assert (opts.log_dir, opts.debug, opts.nnodes) == ("logs", True, 1)  # nnodes: the default
    opts = _options("--nproc-per-node", "2", "--max_restarts", "0")
    assert (opts.nproc_per_node, opts.max_restarts, opts.rdzv_timeout) == (2, 0, 60)


def test_pyproject_table_is_read_and_rankwise_toml_wins(here):
    (here / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.rankwise]\nnnodes = "1:4"\n')
    opts = _options()
    assert (opts.min_nodes, opts.nnodes) == (1, 4)
    (here / "rankwise.toml").write_text("nproc-per-node = 2\n")
    opts = _options()
    assert (opts.nproc_per_node, opts.nnodes) == (2, 1)  # one file is read, not both


def test_no_file_means_the_defaults(here):
    (here / "pyproject.toml").write_text('[project]\nname = "x"\n')  # no [tool.rankwise]
    opts = _options()
    assert (opts.nproc_per_node, opts.nnodes, opts.max_restarts, opts.prefix_output) == (1, 1, 0, True)


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("nproc_per_nod = 2", ["'nproc_per_nod'", "did you mean 'nproc-per-node'?"]),
        ("max-restarts = 'two'", ["max-restarts = 'two'", "a whole number"]),
        ("nproc-per-node = 'many'", ["nproc-per-node = 'many'", '"auto"']),
        ("debug = 1", ["debug = 1", "true or false"]),
        ("nnodes = = 2", ["is not valid TOML"]),
        ("rdzv-token = 'hunter2'", ["rdzv-token is a secret", "RANKWISE_RDZV_TOKEN"]),
    ],
)
def test_a_bad_setting_names_the_file_the_key_and_the_fix(here, line, named, capsys):
    (here / "rankwise.toml").write_text(line + "\n")
    with pytest.raises(ConfigError) as exc:
        _options()
    assert str(here / "rankwise.toml") in str(exc.value)
    for fact in named:
        assert fact in str(exc.value)
    assert main(["run", "train.py"]) == 2  # the CLI: exit status 2, message on stderr
    assert "rankwise run: error:" in capsys.readouterr().err


def test_the_launcher_says_which_file_it_read(here, capsys, monkeypatch):
    import rankwise.launch.engine as engine

    launched = []
    monkeypatch.setattr(engine, "launch", launched.append)
    (here / "rankwise.toml").write_text("nproc-per-node = 2\nmax-restarts = 1\n")
    assert main(["run", "--nproc-per-node", "4", "train.py"]) == 0
    err = capsys.readouterr().err
    assert "settings from rankwise.toml: max-restarts = 1" in err
    assert "the command line overrides --nproc-per-node 4 (the file's 2)" in err
    assert (launched[0].nproc_per_node, launched[0].max_restarts) == (4, 1)


def _config(argv: list[str], answers: str | None, monkeypatch, capsys) -> str:
    if answers is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(answers))
    assert main(["config", *argv]) == 0
    return capsys.readouterr().out


def test_config_asks_and_writes_what_run_then_reads(here, monkeypatch, capsys):
    # nproc-per-node, nnodes, node-rank, master-addr, master-port, rdzv-timeout, restarts, logs
    out = _config([], "2\n2\n1\n10.0.0.1\nnot-a-port\n29500\n\n3\n\n", monkeypatch, capsys)
    assert "(--nproc-per-node) [1]: 2" in out and "(--rdzv-timeout) [300]: " in out
    assert "master-port = 'not-a-port' (str) is not a whole number" in out  # asked again
    written = tomllib.loads((here / "rankwise.toml").read_text())
    assert written == {"nproc-per-node": 2, "nnodes": 2, "node-rank": 1,
                       "master-addr": "10.0.0.1", "master-port": 29500, "max-restarts": 3}
    opts = _options()
    assert (opts.nproc_per_node, opts.nnodes, opts.node_rank, opts.master_port) == (2, 2, 1, 29500)
    # asked again, the file's values are the defaults: Enter everywhere keeps them
    _config([], "\n" * 10, monkeypatch, capsys)
    assert tomllib.loads((here / "rankwise.toml").read_text()) == written


def test_config_from_flags_keeps_the_files_other_settings(here, monkeypatch, capsys):
    _config(["--nproc-per-node", "2", "--max-restarts", "1"], None, monkeypatch, capsys)
    _config(["--max_restarts", "4", "--no-prefix"], None, monkeypatch, capsys)
    written = tomllib.loads((here / "rankwise.toml").read_text())
    assert written == {"nproc-per-node": 2, "max-restarts": 4, "no-prefix": True}


def test_config_show_says_where_each_value_comes_from(here, monkeypatch, capsys):
    (here / "rankwise.toml").write_text("nproc-per-node = 2\nmax-restarts = 1\n")
    shown = json.loads(_config(["--show", "--json", "--max-restarts", "5"], None, monkeypatch,
                               capsys))
    assert shown["file"] == str(here / "rankwise.toml")
    got = {k: (v["value"], v["from"]) for k, v in shown["settings"].items()}
    assert got["nproc-per-node"] == (2, "rankwise.toml")
    assert got["max-restarts"] == (5, "command line")
    assert got["rdzv-timeout"] == (300, "default")
    table = _config(["--show"], None, monkeypatch, capsys)
    assert "settings file: rankwise.toml" in table
    assert any(line.split() == ["nproc-per-node", "2", "rankwise.toml"] for line in table.splitlines())


def test_config_into_pyproject_appends_a_table_once_then_merges(here, monkeypatch, capsys):
    (here / "pyproject.toml").write_text('[project]\nname = "x"\n')
    _config(["--config", "pyproject.toml", "--nproc-per-node", "2"], None, monkeypatch, capsys)
    doc = tomllib.loads((here / "pyproject.toml").read_text())
    assert doc == {"project": {"name": "x"}, "tool": {"rankwise": {"nproc-per-node": 2}}}
    assert _options().nproc_per_node == 2
    _config(["--config", "pyproject.toml", "--nproc-per-node", "3"], None, monkeypatch, capsys)
    doc = tomllib.loads((here / "pyproject.toml").read_text())
    assert doc == {"project": {"name": "x"}, "tool": {"rankwise": {"nproc-per-node": 3}}}


_PYPROJECT = """[project]
name = "x"  # the package

[tool.rankwise]
# two processes on this machine
nproc_per_node = 2
debug = false

[tool.ruff]
line-length = 100
"""


def test_config_merges_into_the_pyproject_table_that_holds_the_settings(here, monkeypatch, capsys):
    """Issue 43: `[tool.rankwise] nproc-per-node = 2`, then `rankwise config --max-restarts 2`
    wrote a rankwise.toml that silently overrode it (the job started 1 process)."""
    (here / "pyproject.toml").write_text(_PYPROJECT)
    out = _config(["--max-restarts", "2"], None, monkeypatch, capsys)
    assert not (here / "rankwise.toml").exists()
    assert "wrote " in out and "pyproject.toml [tool.rankwise]" in out
    text = (here / "pyproject.toml").read_text()
    doc = tomllib.loads(text)
    assert doc["tool"]["rankwise"] == {"nproc_per_node": 2, "debug": False, "max-restarts": 2}
    assert doc["tool"]["ruff"] == {"line-length": 100} and doc["project"] == {"name": "x"}
    assert "# two processes on this machine\n" in text and 'name = "x"  # the package' in text
    opts = _options()
    assert (opts.nproc_per_node, opts.max_restarts) == (2, 2)  # the job starts 2 processes
    _config(["--nproc-per-node", "4"], None, monkeypatch, capsys)  # on its line, its spelling
    assert tomllib.loads((here / "pyproject.toml").read_text())["tool"]["rankwise"] == {
        "nproc_per_node": 4, "debug": False, "max-restarts": 2}


def test_a_rankwise_toml_that_hides_the_pyproject_table_is_said(here, monkeypatch, capsys):
    (here / "pyproject.toml").write_text(_PYPROJECT)
    (here / "rankwise.toml").write_text("max-restarts = 1\n")
    shown = _config(["--show"], None, monkeypatch, capsys)
    assert "pyproject.toml [tool.rankwise] is not read" in shown and "nproc-per-node = 2" in shown
    as_json = json.loads(_config(["--show", "--json"], None, monkeypatch, capsys))
    assert as_json["not_read"] == {"nproc-per-node": 2, "debug": False}
    from rankwise.launch.config.settings import resolve

    line = resolve({}, here).announce()
    assert "settings from rankwise.toml: max-restarts = 1" in line
    assert "pyproject.toml [tool.rankwise] is not read" in line and "nproc-per-node = 2" in line


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("nproc-per-node = 0", ["nproc-per-node = 0", "at least 1"]),
        ("nnodes = 0", ["nnodes = 0", "at least 1"]),
        ('nnodes = "3:1"', ["nnodes = '3:1'", "1 <= MIN <= MAX"]),
        ("master-port = 70000", ["master-port = 70000", "between 1 and 65535"]),
        ("max-restarts = -1", ["max-restarts = -1", "at least 0"]),
    ],
)
def test_config_show_refuses_values_out_of_range(here, line, named, capsys):
    (here / "rankwise.toml").write_text(line + "\n")
    assert main(["config", "--show"]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in named), err
    assert "Fix:" in err


def test_missing_config_file_is_named(here, capsys):
    assert main(["run", "--config", "nope.toml", "train.py"]) == 2
    assert "--config nope.toml: no such file" in capsys.readouterr().err


def test_the_writer_round_trips_through_tomllib():
    values = {"log-dir": 'runs/"quoted" \\ back\tslash é\n', "master-port": 29500,
              "debug": False, "nnodes": "1:4"}
    assert tomllib.loads(to_toml(values)) == values


def test_the_rendezvous_secret_is_a_flag_never_a_setting(here, capsys):
    (here / "rankwise.toml").write_text("nproc-per-node = 2\n")
    assert _options("--rdzv-token", "s3cret").rdzv_token == "s3cret"
    with pytest.raises(SystemExit):
        main(["config", "--rdzv-token", "s3cret"])
    assert "unrecognized argument --rdzv-token" in capsys.readouterr().err
    assert "s3cret" not in (here / "rankwise.toml").read_text()
