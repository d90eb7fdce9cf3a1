"""The shape of the code, kept by tests: no import cycles, every module importable on its own,
functions and files small enough to read in one sitting (docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
MAX_FUNCTION_LINES = 50
MAX_FILE_LINES = 400


def _tool():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools/import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_import_graph_has_no_cycle():
    """Every import counts: function-local ones and those under TYPE_CHECKING too."""
    tool = _tool()
    graph = tool.edges(tool.modules(SRC))
    assert len(graph) > 50  # the walk found the package
    assert tool.cycles(graph) == []


def test_a_circle_through_type_checking_imports_is_a_circle(tmp_path):
    pkg = tmp_path / "rankwise"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("from .hooks import Hooks\n")
    (pkg / "hooks.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .engine import Engine\n"
    )
    tool = _tool()
    graph = tool.edges(tool.modules(tmp_path))
    assert graph["rankwise.hooks"] == {"rankwise.engine"}
    assert tool.cycles(graph) == [["rankwise.engine", "rankwise.hooks"]]


def test_a_circle_through_a_script_guard_is_a_circle(tmp_path):
    """``if __name__ == "__main__": from .cli import main`` in a module cli.py imports is the
    circle doctor.py once had: counted, so the entry point goes through cli.py instead."""
    pkg = tmp_path / "rankwise"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("from .doctor import run_checks\n")
    (pkg / "doctor.py").write_text(
        "def run_checks():\n    pass\n\n"
        "if __name__ == '__main__':\n    from .cli import main\n    main()\n"
    )
    tool = _tool()
    graph = tool.edges(tool.modules(tmp_path))
    assert graph["rankwise.doctor"] == {"rankwise.cli"}
    assert tool.cycles(graph) == [["rankwise.cli", "rankwise.doctor"]]


def test_ci_runs_the_import_cycle_check_before_the_tests():
    steps = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python tools/import_cycles.py" in steps
    tests = [i for i, step in enumerate(steps) if step.startswith("python -m pytest")]
    assert tests and steps.index("python tools/import_cycles.py") < tests[0]


def test_runtime_imports_nothing_above_the_ground_floor():
    tool = _tool()
    graph = tool.edges(tool.modules(SRC))
    ground = {"rankwise.errors", "rankwise.job.env", "rankwise.job.netif", "rankwise.job.devices"}
    ground |= {"rankwise.job.plan", "rankwise.job.process_group", "rankwise.runtime"}
    ground |= {"rankwise.strategies", "rankwise.job.mesh", "rankwise.validate"}
    for name in sorted(ground):
        assert graph[name] <= ground, (name, graph[name] - ground)


def test_every_module_imports_on_its_own():
    """Each module imported first, with no other rankwise module loaded (as in a fresh
    interpreter; torch stays loaded, to keep this fast): an import that works only after
    another module was imported is a hidden cycle or a missing import."""
    # ``__main__`` modules run the CLI when imported: the CLI tests cover them.
    names = sorted(n for n in _tool().modules(SRC) if not n.endswith("__main__"))
    probe = (
        "import sys, importlib, traceback\n"
        "import torch\n"
        f"names = {names!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'rankwise' or m.startswith('rankwise.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append((name, traceback.format_exc(limit=3)))\n"
        "print(failed)\n"
    )
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=240, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def _sizes():
    for path in sorted((SRC / "rankwise").rglob("*.py")):
        text = path.read_text()
        yield path.relative_to(SRC), len(text.splitlines()), ast.parse(text)


def test_no_file_over_400_lines():
    long = {str(p): n for p, n, _ in _sizes() if n > MAX_FILE_LINES}
    assert long == {}


def test_no_function_over_50_lines():
    long = {}
    for path, _, tree in _sizes():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path}:{node.lineno} {node.name}"] = lines
    assert long == {}


def _project_text():
    for folder in ("src", "tests", "docs", "examples", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md") and "results" not in path.parts:
                yield path, path.read_text(encoding="utf-8")
    yield ROOT / "README.md", (ROOT / "README.md").read_text(encoding="utf-8")


def test_pitfalls_are_cited_by_anchors_that_exist():
    """Code, tests and docs cite the anchors of docs/pitfalls.md, never a source document."""
    import re

    anchors = set(re.findall(r'<a id="([\w-]+)"></a>', (ROOT / "docs/pitfalls.md").read_text()))
    assert {f"pitfall-{n}" for n in range(1, 7)} <= anchors
    seed = "se" + "ed"  # spelled apart, so this test does not find itself
    source_words = re.compile(f"the {seed}|{seed}'s|{seed} pitfall", re.IGNORECASE)
    cited, stray = set(), []
    for path, text in _project_text():
        cited |= set(re.findall(r"pitfalls\.md#([\w-]+)", text))
        stray += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in source_words.finditer(text)]
    assert cited and cited <= anchors, cited - anchors
    assert stray == []


def test_rw_init_returns_the_runtime_with_the_one_call_api():
    """``rw.init`` is the session layer's; the runtime below it never imports the session.
    A runtime made by a lower layer first is the same data, and ``rw.init`` returns it as a
    ``Session``; ``rt.print`` is ``rw.print0`` itself (one implementation, two spellings)."""
    import rankwise as rw
    from rankwise import runtime

    rw.shutdown()
    try:
        low = runtime.init()
        assert type(low) is runtime.Runtime
        rt = rw.init()
        assert isinstance(rt, rw.Session) and isinstance(rt, rw.Runtime)
        assert (rt.env, rt.device, rt.strategy) == (low.env, low.device, low.strategy)
        assert rw.get_runtime() is rt and rw.init() is rt
        assert rt.print is rw.print0
        assert runtime.coords() == runtime.Coords(0, 1, 1, "runtime")
    finally:
        rw.shutdown()


MAX_FOLDER_MODULES = 12


def _floor_layers() -> dict[str, int]:
    """docs/architecture.md's table: each entry of the top floor -> its layer number."""
    text = (ROOT / "docs/architecture.md").read_text()
    table = text.split("## The floor, bottom to top", 1)[1].split("\n\n", 2)[1]
    layers = {}
    for row in table.splitlines()[2:]:
        cells = row.split("|")
        number = int(cells[1].strip().split(".")[0])
        for entry in cells[2].split("`")[1::2]:
            layers[entry.rstrip("/").removesuffix(".py")] = number
    return layers


def test_the_layer_table_names_the_whole_floor():
    top = SRC / "rankwise"
    floor = {p.stem for p in top.glob("*.py")} | {
        p.name for p in top.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    }
    assert set(_floor_layers()) == floor


def test_nothing_imports_from_a_higher_layer():
    """A module imports from its own layer or below (the table in docs/architecture.md)."""
    layers, tool = _floor_layers(), _tool()
    graph = tool.edges(tool.modules(SRC))

    def layer(module: str) -> int:
        parts = module.split(".")
        return layers[parts[1] if len(parts) > 1 else "__init__"]

    upward = sorted(
        f"{a} (layer {layer(a)}) -> {b} (layer {layer(b)})"
        for a, targets in graph.items() for b in targets if layer(b) > layer(a)
    )  # fmt: skip
    assert upward == []


def test_no_folder_holds_more_than_twelve_modules():
    crowded = {
        str(d.relative_to(SRC)): n
        for d in [SRC / "rankwise", *(SRC / "rankwise").rglob("*")]
        if d.is_dir() and (n := len(list(d.glob("*.py")))) > MAX_FOLDER_MODULES
    }
    assert crowded == {}
