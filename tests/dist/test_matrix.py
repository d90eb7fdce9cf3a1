"""The strategy matrix: the README's loop under every strategy the library lists, with the
optimizers, loops, precisions and schedules users write, against one process trained by hand.

Cases are in ``matrix_cases.py``; all cases of one world size run inside ONE spawned job (one
rank set, ``rw.init`` per case), so the matrix costs two process starts, not one per case.
A strategy joins the matrix by joining the library's list (``matrix_cases._strategies``).
"""

from __future__ import annotations

import time

import matrix_cases as mc

from rankwise.testing import run_distributed


def _run(world: int, tmp_path) -> dict:
    start = time.perf_counter()
    ranks = run_distributed(mc.run_matrix, world, args=(world, str(tmp_path)), init=False,
                            timeout=280)  # fmt: skip
    ran = [n for n, r in ranks[0].items() if not isinstance(r, str) or "Traceback" in r]
    worst: dict[str, float] = {}
    for name, r in ranks[0].items():
        if isinstance(r, dict):
            precision = name.rsplit("/", 1)[1]
            worst[precision] = max(worst.get(precision, 0.0), r["oracle"])
    print(f"strategy matrix at world {world}: {len(ran)} cases in "
          f"{time.perf_counter() - start:.1f} s; largest difference to the oracle per "
          f"precision: {worst}")  # fmt: skip
    for rank, results in enumerate(ranks):
        bad = mc.failures(results)
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)
    return ranks[0]


def test_every_strategy_at_world_one_equals_one_process_and_resumes_exactly(tmp_path):
    results = _run(1, tmp_path)
    strategies = mc._strategies()
    # Every strategy ran every case of the main matrix (none was refused at world 1).
    want = len(strategies) * len(mc.OPTIMIZERS) * len(mc.LOOPS) * len(mc.PRECISIONS)
    assert len([r for r in results.values() if isinstance(r, dict)]) == want


def test_every_process_strategy_at_world_two_equals_one_process_and_resumes_exactly(tmp_path):
    results = _run(2, tmp_path)
    refused = {n for n, r in results.items() if isinstance(r, str)}
    ran = {n.split("/")[0] for n, r in results.items() if isinstance(r, dict)}
    assert ran | refused == set(mc._strategies())
    assert {"ddp", "zero1", "zero2", "zero3"} <= ran
    # Every optimizer class the sharded engine accepts, through rt.prepare, at world 2.
    for strategy in ("zero2", "zero3"):
        for name in mc.ELEMENTWISE:
            assert isinstance(results[f"{strategy}/{name}/plain/32"], dict)
    # A bucket on each side of the shared-memory threshold, under every strategy that ran.
    for strategy in ran:
        for loop in mc.LOOPS:
            wide = results[f"{strategy}/adamw-groups@wide/{loop}/32"]
            small = results[f"{strategy}/adamw-groups/{loop}/32"]
            assert isinstance(wide, dict) and isinstance(small, dict)
            # DDP, stages 1 and 3 take the shared-memory path for the wide net's large units.
            assert wide["shared_memory"] is (strategy in ("ddp", "zero1", "zero3")), (
                strategy, loop)  # fmt: skip
            assert small["shared_memory"] is False, (strategy, loop)
