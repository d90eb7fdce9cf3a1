"""The fast tier: `python -m pytest -m fast`, the README's second command.

A curated selection, at most a few minutes on two quiet cores, that still touches every feature:
every module of ``src/rankwise`` is imported by at least one fast test, in the test process or
in a process it starts (``tests/unit/test_fast_tier.py`` checks it at the end of a fast run).
The whole suite (``python -m pytest``, ``.ci/run``) runs everything, the fast tier included.

A test is in the full tier only, unless ``FAST`` names it: a new test file stays out of the
fast tier until it is listed here (its file, for a file of quick in-process tests; a test by
name, ``file::test``, for a test that starts processes). Keep the tier fast: add a test here
when it covers something no fast test covers, and take the cheapest test that does.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import pytest

UNIT = "tests/unit/"
DIST = "tests/dist/"
E2E = "tests/e2e/"
DOCS = UNIT + "test_docs_run.py::"

FAST: dict[str, tuple[str, ...]] = {
    "in one process: pure pieces, engines at world 1, the checker, the CLIs' parsing": tuple(
        UNIT + name for name in (
            "test_api_validation.py", "test_architecture.py", "test_bench_model.py",
            "test_bench_plot.py", "test_buckets.py", "test_check_cli.py", "test_check_corpus.py",
            "test_check_crossfile.py", "test_check_multinode.py", "test_check_rules.py",
            "test_check_session_api.py", "test_checkpoint.py", "test_claims.py",
            "test_checkpoint_reliability.py", "test_dashboard.py",
            "test_checkpoint_sharded_unit.py", "test_checkpoint_verify.py",
            "test_checkpoint_refusals.py", "test_untrusted_inputs.py",
            "test_cli_consistency.py", "test_data_parallel.py",
            "test_ddp_single.py", "test_ddp_torch_compat.py", "test_device_paths.py",
            "test_diagnose_report.py", "test_doctor.py", "test_dp_pieces.py", "test_env.py",
            "test_fast_tier.py", "test_launch_native_log.py",
            "test_goodput.py",
            "test_launch_options.py", "test_launch_output.py", "test_loader.py",
            "test_loader_epochs.py", "test_loop.py", "test_mesh.py", "test_models.py",
            "test_no_pickle_from_peers.py", "test_pipeline.py", "test_pipeline_schedules.py",
            "test_pipeline_wire.py",
            "test_pretrained.py",
            "test_pretrained_slices.py", "test_progress_notebook.py", "test_progress_output.py",
            "test_ps_never_blocks.py", "test_ps_protocol_faults.py", "test_public_api.py",
            "test_raw_collective_watch.py", "test_sampler.py", "test_save_every_rank_not_seen.py",
            "test_session.py", "test_shared_reduce.py", "test_silent_mistakes.py",
            "test_small_guards.py", "test_small_new_user.py", "test_stall_and_blame.py",
            "test_strategies.py", "test_tensor_parallel_unit.py", "test_topology.py",
            "test_timing.py", "test_timing_links.py",
            "test_trackers.py",
            "test_updates_unit.py", "test_zero_api.py", "test_zero_unit.py",
            "test_check_mistakes_rules.py", "test_guarded_collective_diagnosis.py",
        )
    ),
    "docs: the convention, and the pages whose blocks run in one process": (
        DOCS + "test_every_page_has_been_found",
        DOCS + "test_illustrative_blocks_say_what_this_machine_cannot_do",
        DOCS + "test_headers_are_well_formed",
        DOCS + "test_a_dodge_is_refused",
        DOCS + "test_a_real_reason_is_accepted",
        DOCS + "test_numbers_vary_only_where_the_fence_says_so",
        DOCS + "test_commands_are_bash_blocks",
        DOCS + "test_session_log_lines_are_the_real_ones",
        DOCS + "test_session_unknown_strategy_message_is_the_real_one",
        *(DOCS + f"test_blocks_run[{page}]" for page in (
            "check.md", "data.md", "ddp.md", "dp.md", "pitfalls.md", "recipes.md")),
    ),
    "DDP and the one-call API, against one process and torch": (
        DIST + "test_ddp.py::test_world2_every_case_matches_single_process_and_torch",
        DIST + "test_session_dist.py::test_single_dp_and_ddp_reach_the_same_parameters",
        DIST + "test_strategies_dist.py::test_every_strategy_runs_the_readme_loop_and_matches_one_process",
        DIST + "test_loop_dist.py::test_accumulate_under_ddp_communicates_once_per_group_and_equals_the_big_batch",
        DIST + "test_silent_mistakes_dist.py::test_rt_save_refuses_replicas_that_drifted_apart_and_writes_nothing",
    ),
    "ZeRO, meta-device models, pretrained weights": (
        DIST + "test_zero_api_dist.py::test_zero3_nanogpt_shape_with_groups_and_tied_weights_equals_one_process_and_generates",
        DIST + "test_meta_init.py::test_meta_model_equals_eager_build_and_default_init_is_sound[zero3]",
        DIST + "test_pretrained_dist.py::test_rankwise_gpt_loads_from_its_own_safetensors_file_under_zero3",
    ),
    "model parallel: pipelines, tensor parallel, meshes": (
        DIST + "test_pipeline_dist.py::test_two_rank_pipeline_equals_single_process_after_10_steps",
        DIST + "test_mesh_dist.py::test_gpt_on_a_data_2_by_tensor_2_mesh_equals_one_process",
    ),
    "checkpoints, data, update rules, runtime and output": (
        DIST + "test_checkpoint_dist.py::test_every_rank_saves_one_file_chosen_by_rank_0",
        DIST + "test_checkpoint_sharded.py::test_a_zero3_sharded_save_gathers_no_parameter",
        UNIT + "test_checkpoint_cli.py::test_inspect_names_keys_shapes_the_save_and_the_checksums",
        UNIT + "test_checkpoint_cli.py::test_consolidate_writes_the_full_state_as_one_loadable_file",
        DIST + "test_data_dist.py::test_join_stops_uneven_ranks_together_without_hanging",
        DIST + "test_updates_dist.py::test_staleness_zero_equals_synchronous_training_exactly",
        DIST + "test_runtime_comm.py::test_collectives_at_world_2",
        DIST + "test_output.py::test_only_rank_0_prints_logs_and_shows_a_bar",
        DIST + "test_testing_helper.py::test_failing_rank_is_named_with_its_traceback",
    ),
    "diagnosis: a mismatched collective is named": (
        DIST + "test_diagnose.py::test_barrier_only_on_rank0_is_caught_by_the_check",
    ),
    "launching: rankwise run, rw.launch, the README's demo": (
        E2E + "test_launch.py::test_a_failing_rank_stops_all_and_is_named",
        E2E + "test_launch.py::test_legacy_launcher_passes_local_rank",
        E2E + "test_launch_notebook.py::test_launch_a_function_defined_in_main_and_reraise_a_failed_rank",
        E2E + "test_digits.py::test_readme_command_trains_to_95_percent_with_two_processes",
        E2E + "test_doctor_cli.py::test_doctor_json_exits_nonzero_on_a_busy_port",
    ),
    "metrics that cannot lie, SyncBatchNorm, settings and launcher errors (issue 43)": (
        DIST + "test_print_crosscheck.py::test_a_print_on_rank_0_alone_does_not_hang_and_adds_nothing",
        DIST + "test_print_crosscheck.py::test_accuracy_from_item_on_each_rank_says_ranks_differ_and_the_mean[2]",
        DIST + "test_eval_loader_counts.py::test_an_unnamed_unshuffled_loader_that_pads_says_how_many_duplicates",
        DIST + "test_sync_batchnorm.py::test_sync_batchnorm_equals_one_process_on_the_global_batch[sizes1]",
        UNIT + "test_settings_file.py",
        E2E + "test_launch_errors_once.py::test_a_syntax_error_is_reported_once_before_any_worker_starts",
        DOCS + "test_every_block_runs_alone_or_says_what_it_continues",
    ),
    "the benchmark and the checker as commands": (
        DOCS + "test_blocks_run[bench.md]",
        E2E + "test_bench.py::test_comm_bench_rows",
        E2E + "test_check_module.py::test_python_dash_m_rankwise_check",
        E2E + "test_mistakes_corpus.py::test_the_pitfalls_table_is_generated_from_the_corpus",
    ),
    "in-memory replicas (issue 45): format, buddy map, global-batch rule, one-process restore": (
        UNIT + "test_replicas.py",
    ),
}
"""Feature area -> the fast tests that cover it (a file, or a test by name)."""

NO_CREDIT = (UNIT + "test_architecture.py", UNIT + "test_public_api.py")
"""Tests that import every module to inspect it: they run last and count for no module."""

IMPORTS = Path(__file__).resolve().parent / "_imports"  # its sitecustomize logs child imports
LOG_VAR = "RANKWISE_IMPORT_LOG"
DIR_VAR = "RANKWISE_FAST_TIER_LOG"  # the run's folder, for xdist's workers
SRC = Path(__file__).resolve().parents[1] / "src"


def entries() -> list[str]:
    return [e for group in FAST.values() for e in group]


def selects(entry: str, nodeid: str) -> bool:
    return nodeid == entry or nodeid.startswith(entry + ("::" if entry.endswith(".py") else "["))


def is_fast(nodeid: str) -> bool:
    return any(selects(e, nodeid) for e in entries())


def mark(items: list[pytest.Item]) -> None:
    """Mark the fast tests `fast`; in a fast run, the census tests and the check go last."""
    for item in items:
        if is_fast(item.nodeid):
            item.add_marker(pytest.mark.fast)
    last = [i for i in items if any(i.nodeid.startswith(n) for n in NO_CREDIT)]
    check = [i for i in items if i.name == "test_the_fast_tier_touches_every_module"]
    items[:] = [i for i in items if i not in last and i not in check] + last + check


def start(config: pytest.Config) -> None:
    """In a fast run, every process started from a test logs the rankwise modules it imported.

    Under pytest-xdist (``-n 2``, as .ci/run runs it) the workers, started after this runs in
    the controller, inherit the controller's log folder through ``DIR_VAR``: the census is
    taken over every worker's tests by the controller, once all have ended
    (``pytest_sessionfinish``)."""
    if config.option.markexpr != "fast":
        return
    shared = os.environ.get(DIR_VAR) if hasattr(config, "workerinput") else None
    config.fast_tier_log = Path(shared or tempfile.mkdtemp(prefix="rankwise-fast-"))
    os.environ[DIR_VAR] = str(config.fast_tier_log)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(IMPORTS), os.environ.get("PYTHONPATH", "")])
    if hasattr(config.option, "loadscopereorder"):  # xdist would send the files with most
        config.option.loadscopereorder = False  # tests first: NO_CREDIT's must stay last
    config.fast_tier_ran = _Ran()
    config.pluginmanager.register(config.fast_tier_ran, "fast_tier_ran")


def _folder(config: pytest.Config, nodeid: str) -> Path:
    """The test's log folder: a short name (node ids can pass the file-name limit), its id inside."""
    folder = config.fast_tier_log / hashlib.sha1(nodeid.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "nodeid").write_text(nodeid)
    return folder


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Records what a fast test imported (here: new in sys.modules; its children: their logs)."""
    log = getattr(item.config, "fast_tier_log", None)
    if log is None:
        return (yield)
    folder = _folder(item.config, item.nodeid)
    before, os.environ[LOG_VAR] = set(sys.modules), str(folder)
    try:
        return (yield)
    finally:
        del os.environ[LOG_VAR]
        new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "rankwise")
        (folder / "this-process.txt").write_text("\n".join(new))


def touched(config: pytest.Config, exclude: tuple[str, ...]) -> dict[str, list[str]]:
    """Module -> the fast tests that imported it (in their own process or in one they started)."""
    found: dict[str, list[str]] = {}
    for folder in sorted(config.fast_tier_log.iterdir()):
        test = (folder / "nodeid").read_text()
        if test.startswith(exclude):
            continue
        for log in folder.glob("*.txt"):
            for module in log.read_text().split():
                found.setdefault(module, []).append(test)
    return found


def modules() -> list[str]:
    """Every module of src/rankwise, by its dotted name."""
    names = []
    for path in sorted((SRC / "rankwise").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def census(config: pytest.Config, ran: set[str]) -> tuple[str | None, list[str]]:
    """(why no census can be taken, or None; the modules no fast test imported) for a run of
    the tests ``ran`` (node ids)."""
    if getattr(config, "fast_tier_log", None) is None or config.option.keyword:
        return "checks a whole fast run: python -m pytest -m fast", []
    missing = [e for e in entries() if not any(selects(e, n) for n in ran)]
    if missing:
        return f"not the whole fast tier in this run: {missing[:3]} ...", []
    found = touched(config, NO_CREDIT)
    return None, [m for m in modules() if m not in found]


def untouched_message(untouched: list[str]) -> str:
    return (
        f"{len(untouched)} modules of src/rankwise are imported by no fast test (nor by a process "
        f"one starts), so `pytest -m fast` would pass with them broken:\n  "
        + "\n  ".join(untouched)
        + "\nAdd the cheapest test that exercises each to FAST in tests/fast_tier.py."
    )


def under_xdist(config: pytest.Config) -> bool:
    """This process is an xdist worker, or the controller of several."""
    return hasattr(config, "workerinput") or bool(getattr(config.option, "numprocesses", None))


class _Ran:
    """The controller of an xdist run learns which tests ran from the workers' reports."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.ids.add(report.nodeid)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under xdist, the census of the whole fast run, once every worker has ended: a module no
    fast test imported fails the run (a worker's own census test skips: it cannot wait for
    the other workers)."""
    config = session.config
    ran = getattr(config, "fast_tier_ran", None)
    if ran is None or hasattr(config, "workerinput") or not under_xdist(config):
        return
    why, untouched = census(config, ran.ids)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if why is not None:
        reporter and reporter.write_line(f"fast tier census: skipped ({why})")
        return
    if untouched:
        reporter and reporter.write_line("fast tier census FAILED: " + untouched_message(untouched),
                                         red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif reporter:
        reporter.write_line(f"fast tier census: every one of {len(modules())} modules of "
                            "src/rankwise was imported by a fast test")
