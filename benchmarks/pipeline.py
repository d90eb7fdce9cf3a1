"""Pipelines, measured: every schedule across processes beside ``torch.distributed.pipelining``,
and ``rw.split``'s GPipe bubble in one process.

    flock /tmp/rankwise-bench.lock python benchmarks/pipeline.py --out benchmarks/results/pipeline.json
    python benchmarks/pipeline.py --quick          # a smoke test: tiny sizes, 1 repeat

``schedules`` (``_pipeline_schedules.py``): at 2 and 4 stages (Gloo, CPU, one process per
stage, one thread each), a GPT of ``--layers`` blocks, ``--micro`` micro-batches: step time,
bubble (idle fraction of each stage) and peak activation memory per stage, ours
(``rw.DistributedPipeline``) beside torch's schedule of the same name on the same stages, same
run, alternating. ``simulated``: the same with layers that sleep instead of computing (the
schedules' bubble without the stages competing for CPU cores). ``targets`` checks the figures
against the issue's targets. ``split`` (``_pipeline_split.py``): ``rw.split``'s threads,
unsplit vs chunks.

The machine may be shared: times are noisy (the JSON says how many cores there were);
activation memory is exact (bytes autograd saves, counted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _pipeline_schedules import SIM_LAYERS, bench_rank, merge_ranks
from _pipeline_split import Sleep, compute_model, parallel_efficiency, run_setup
from _pipeline_table import table, targets_lines
from _report import emit

from rankwise.testing import run_distributed


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def targets(rows_by_p: dict[str, list[dict]], memory: bool = True) -> dict[str, bool | None]:
    """The issue's targets, from the rows (None when the row was not run; the memory ones
    only where the model is real)."""

    def row(p: str, name: str, v: int, m: int) -> dict | None:
        return next((r for r in rows_by_p.get(p, []) if r["schedule"] == name
                     and r["stages_per_rank"] == v and r["m"] == m), None)  # fmt: skip

    def bubble_ms(r: dict) -> float:  # mean idle time per stage
        b = r["rankwise"]["bubble_per_stage"]
        return r["rankwise"]["step_ms"] * sum(b) / len(b)

    all_rows = [r for rows in rows_by_p.values() for r in rows]
    out: dict[str, bool | None] = {
        "step_time_at_most_torch": all(r["step_ours_over_torch"] <= 1.0 for r in all_rows),
        # The same, where the repeats can tell: no row slower beyond their spread (_paired)
        "step_time_not_slower_than_torch_beyond_noise": (
            None if any("ratio_paired" not in r for r in all_rows)
            else all(r["ratio_paired"]["verdict"] != "slower" for r in all_rows)),
        "activation_peak_at_most_torch": all(
            max(r["rankwise"]["activation_peak_mb_per_stage"])
            <= max(r["torch"]["activation_peak_mb_per_stage"]) * 1.001 for r in all_rows),
    }  # fmt: skip
    if not memory:
        del out["activation_peak_at_most_torch"]
    for p in rows_by_p if memory else ():
        one, gp = row(p, "1f1b", 1, 16), row(p, "gpipe", 1, 16)
        out[f"p{p}_1f1b_peak_m16_at_most_half_gpipe"] = None if not (one and gp) else (
            max(one["rankwise"]["activation_peak_mb_per_stage"])
            <= 0.5 * max(gp["rankwise"]["activation_peak_mb_per_stage"]))  # fmt: skip
    for m in (4, 8, 16):
        inter, one = row("4", "interleaved_1f1b", 2, m), row("4", "1f1b", 1, m)
        out[f"p4_m{m}_interleaved_bubble_at_most_0.6_1f1b"] = (
            None if not (inter and one) else bubble_ms(inter) <= 0.6 * bubble_ms(one))
    return out


def schedules_section(args: argparse.Namespace, compute: str) -> dict:
    cfg = {"vocab_size": args.vocab, "block_size": args.seq, "n_layer": args.layers,
           "n_head": 4, "n_embd": args.width}  # fmt: skip
    rows = {}
    for p in _ints(args.stages):
        job = (cfg, args.batch, _ints(args.micro), args.repeats, compute, args.stage_ms)
        per_rank = run_distributed(bench_rank, p, args=job, timeout=args.timeout)
        rows[str(p)] = merge_ranks(per_rank)
    model = cfg if compute == "gpt" else {"layers": SIM_LAYERS, "stage_ms": args.stage_ms}
    return {"compute": compute, "model": model, "batch": args.batch, "rows": rows,
            "targets": targets(rows, memory=compute == "gpt")}  # fmt: skip


def split_section(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)  # one core per stage thread: what the stages parallelise
    chunk_list = _ints(args.chunks)
    results = []
    model = compute_model(args.compute_stages, args.layers_per_stage, args.split_width)
    for backward in (False, True):
        results.append(run_setup("compute", model, args.compute_stages, chunk_list,
                                 args.split_batch, args.repeats, args.rounds, backward))  # fmt: skip
    sim = torch.nn.Sequential(*[Sleep(args.sim_stage_ms / 1000 / args.split_batch)
                                for _ in range(args.sim_stages)])  # fmt: skip
    results.append(run_setup("simulated", sim, args.sim_stages, chunk_list, args.split_batch,
                             args.repeats, args.rounds, False))  # fmt: skip
    return {"two_thread_matmul_speedup": parallel_efficiency(args.split_width), "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", choices=["schedules", "simulated", "split", "all"],
                    default="all")  # fmt: skip
    ap.add_argument("--stage-ms", type=float, default=40.0,
                    help="simulated: one stage's forward of the whole batch")  # fmt: skip
    ap.add_argument("--stages", default="2,4", help="schedules: pipeline sizes")
    ap.add_argument("--micro", default="4,8,16", help="schedules: micro-batches per batch")
    ap.add_argument("--layers", type=int, default=8, help="schedules: GPT blocks")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--chunks", default="1,2,4,8,16", help="split: chunk counts")
    ap.add_argument("--split-batch", type=int, default=1024)
    ap.add_argument("--split-width", type=int, default=1024)
    ap.add_argument("--layers-per-stage", type=int, default=3)
    ap.add_argument("--compute-stages", type=int, default=2)
    ap.add_argument("--sim-stages", type=int, default=4)
    ap.add_argument("--sim-stage-ms", type=float, default=40.0, help="per stage, whole batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, 1 repeat")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, metavar="JSON",
                    help="print the Markdown table of a results file, run nothing")  # fmt: skip
    args = ap.parse_args()
    if args.table:
        report = json.loads(Path(args.table).read_text())
        if report.get("args", {}).get("quick") is not False:
            sys.exit(f"{args.table} comes from a --quick run (or says nothing of it): its times "
                     "are a smoke test, not figures for the docs. Fix: run the benchmark "
                     "without --quick and make the table from that JSON.")
        print(f"<!-- generated: python benchmarks/pipeline.py --table {args.table} -->")
        _print_tables(report, sys.stdout, args.table)
        return
    if args.quick:
        args.width, args.seq, args.vocab, args.batch, args.repeats, args.rounds = 32, 16, 64, 16, 1, 1
        args.split_batch, args.split_width, args.chunks = 64, 64, "1,4"
    report = {"benchmark": "pipeline", "torch": torch.__version__, "cpus": os.cpu_count(),
              "args": vars(args), "load_before": os.getloadavg()}  # fmt: skip
    if args.section in ("schedules", "all"):
        report["schedules"] = schedules_section(args, "gpt")
    if args.section in ("simulated", "all"):
        report["simulated"] = schedules_section(args, "simulated")
    if args.section in ("split", "all"):
        report["split"] = split_section(args)
    report["load_after"] = os.getloadavg()
    report["conditions"] = (
        f"{'quick (smoke test: tiny sizes, 1 repeat)' if args.quick else 'full size'}; "
        + (f"simulated stage {args.stage_ms:g} ms a batch; " if "simulated" in report else "")
        + f"{args.repeats} interleaved repeats; load average {report['load_before'][0]:.1f} "
        f"before, {report['load_after'][0]:.1f} after, on {os.cpu_count()} cores"
    )
    emit(report, args.out)
    _print_tables(report)


def _print_tables(report: dict, out=sys.stderr, source: str = "") -> None:
    """The schedules beside torch's, as Markdown (after the JSON, on stderr; with ``--table``
    on stdout, each table followed by its claim marker)."""
    marker = f"\n<!-- claim: {source} -->" if source else ""
    print(f"Conditions: {report.get('conditions', 'not recorded')}.", file=out)
    for key in ("schedules", "simulated"):
        if key in report:
            print(f"\n{key}:\n{table(report[key])}{marker}\n{targets_lines(report[key])}",
                  file=out)  # fmt: skip


if __name__ == "__main__":
    main()
