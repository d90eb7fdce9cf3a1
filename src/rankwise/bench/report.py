"""From raw measurements to the report: per-strategy metrics, projection, recommendation, table.

Definitions (every strategy processes the same global batch ``nproc * batch`` per step):

- ``speedup = single_step / step``: how much faster than one process with one thread;
- ``scaling_efficiency = speedup / workers`` (workers: threads, replicas or processes);
- ``comm_exposed_ms = step - independent_step`` for multi-process strategies: the time the step
  loses to communication and synchronisation beyond the same work with no communication. When
  the load changed between runs the difference can come out negative (a step with
  communication faster than the same work without): it is then not measured, never printed
  as a negative time: ``comm_exposed_ms`` is None, ``comm_measurable`` False, and the
  recommendation's ``confidence`` is 'low' and says why;
- ``peak_mb``: each working rank's peak memory over ``steps`` steps of a fresh strategy;
- ``loss``: the loss of the model after exactly ``steps`` steps, on the global batches.
"""

from __future__ import annotations

import os
import statistics

import torch

from . import strategies as st
from .network import across_nodes
from .network.projection import Network, parse_network, predict, project, validate
from .rows import BASELINE, REPLICATED, THREADS
from .rows import strategy as row_strategy

SCHEMA = "rankwise.bench/1"
CURVE_WORLDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _layout(name: str, n: int) -> str:
    if name == THREADS:
        return f"1 proc x {n} threads"
    spec = row_strategy(name)
    kind = "processes" if spec is None else spec.kind
    return {
        "one": "1 proc x 1 thread",
        "threads": f"1 proc x {n} replicas",
    }.get(kind, f"{n} procs x 1 thread")


def _spread(runs: list[float]) -> dict:
    q = statistics.quantiles(runs, n=4) if len(runs) > 1 else [runs[0]] * 3
    return {
        "median": round(statistics.median(runs), 3),
        "p25": round(q[0], 3),
        "p75": round(q[2], 3),
        "min": min(runs),
        "max": max(runs),
        "runs": runs,
    }


def _rows(cfg, raw: dict) -> list[dict]:
    main, n = raw["main"], cfg.nproc
    times, extra = main["times"], main["memory_loss"]
    global_batch = n * cfg.batch
    single = statistics.median(times[BASELINE])
    indep = statistics.median(times[st.REFERENCE]) if st.REFERENCE in times else None
    rows = []
    for name in [*st.ALL, st.REFERENCE]:
        if name in raw["skipped"]:
            rows.append({"name": name, "available": False, "reason": raw["skipped"][name]})
            continue
        if name not in times:
            continue
        step = _spread(times[name])
        speedup = single / step["median"]
        workers = st.workers(name, n)
        multi = name not in st.ON_RANK0 and name != st.REFERENCE
        comm = step["median"] - indep if multi else None
        rows.append(
            {
                "name": name,
                "available": True,
                "reason": None,
                "layout": _layout(name, n),
                "workers": workers,
                "exact": name in st.EXACT,
                "step_ms": step,
                "samples_per_s": round(global_batch / step["median"] * 1e3, 1),
                "speedup": round(speedup, 3),
                "scaling_efficiency": round(speedup / workers, 3),
                "comm_exposed_ms": round(comm, 3) if comm is not None and comm >= 0 else None,
                "comm_measurable": None if comm is None else comm >= 0,
                "peak_mb": [p for p in extra[name]["peak_mb"] if p is not None],
                "loss": None if extra[name]["loss"] is None else round(extra[name]["loss"], 5),
            }
        )
    return rows


def _projection(cfg, raw: dict, rows: list[dict], grad_bytes: int) -> dict:
    comm = raw["main"]["comm"]
    measured = Network.from_dict(comm["fit"])
    net = parse_network(cfg.network) if cfg.network else measured
    single = next(r for r in rows if r["name"] == BASELINE)
    per_sample = single["step_ms"]["median"] / 1e3 / (cfg.nproc * cfg.batch)
    copy = comm["memcpy_GBps"] * 1e9
    compute_ms = per_sample * cfg.batch * 1e3  # c * B: one rank's batch on one process
    checks = (
        validate(raw["validation"], grad_bytes, measured, copy, compute_ms)
        if raw["validation"]
        else []
    )
    for c in checks:  # the curve's own value at that world size, for the picture's labels
        c["curve_efficiency"] = predict(compute_ms / 1e3, grad_bytes, c["world"], net, copy)[
            "efficiency"
        ]
    return {
        "model": "step = c*B + 2*bytes/memcpy + 2(n-1)*alpha + 2(n-1)/n*bytes*beta "
        "(bucket copies + ring all-reduce, no overlap)",
        "compute_ms_per_sample": round(per_sample * 1e3, 5),
        "per_rank_batch": cfg.batch,
        "gradient_bytes": grad_bytes,
        "network": net.to_dict(),
        "memcpy_GBps": comm["memcpy_GBps"],
        "rows": project(per_sample, cfg.batch, grad_bytes, net, copy),
        "curve": project(per_sample, cfg.batch, grad_bytes, net, copy, CURVE_WORLDS),
        "validation": {
            "strategy": next(iter(raw["validation"].values()), {}).get("strategy", REPLICATED),
            "network": measured.to_dict(),
            "rows": checks,
            "max_abs_error": max((abs(c["error"]) for c in checks), default=None),
        },
        "across_nodes": _across(cfg, per_sample, grad_bytes, copy),
    }


def _across(cfg, per_sample: float, grad_bytes: int, copy: float) -> dict | None:
    """The projection across nodes, with ``--node-network`` (``network/across_nodes.py``)."""
    if cfg.node_network is None:
        return None
    per_node = cfg.ranks_per_node or cfg.nproc
    return across_nodes.block(cfg.node_network, per_node, per_sample, cfg.batch, grad_bytes, copy)


def recommend(rows: list[dict]) -> dict:
    """The fastest exact strategy, with the numbers behind it in one line, and how far to
    trust it (``confidence``: 'normal', or 'low' with the reasons in the text)."""
    ok = [r for r in rows if r["available"] and r["name"] != st.REFERENCE]
    exact = sorted((r for r in ok if r["exact"]), key=lambda r: -r["samples_per_s"])
    best = exact[0]
    parts = [
        f"{r['name']} {r['speedup']:.2f}x (efficiency {r['scaling_efficiency']:.2f}{_comm_words(r)})"
        for r in exact[1:]
    ]
    head = (
        f"{best['name']} ({best['layout']}): {best['speedup']:.2f}x one process "
        f"(efficiency {best['scaling_efficiency']:.2f}, {best['step_ms']['median']:.1f} ms/step, "
        f"{best['samples_per_s']:.0f} samples/s)"
    )
    if best["name"] == BASELINE:
        head = f"{BASELINE}: no parallel strategy beat one process ({best['step_ms']['median']:.1f} ms/step)"
    runner_up = exact[1] if len(exact) > 1 else None
    if runner_up and runner_up["step_ms"]["min"] <= best["step_ms"]["median"]:
        head += f", tied with {runner_up['name']} within run-to-run spread"
    notes = _notes(ok, exact, best)
    text = f"Recommendation: {head}; vs " + "; ".join(parts) if parts else f"Recommendation: {head}"
    if notes:
        text += ". Note: " + "; ".join(notes)
    doubts = _doubts(ok, exact, best)
    if doubts:
        text += (f". Confidence: low, {'; '.join(doubts)}: rerun when the machine is as quiet "
                 "as it will be for training")
    return {"strategy": best["name"], "confidence": "low" if doubts else "normal",
            "text": text + "."}


def _comm_words(r: dict) -> str:
    if r.get("comm_measurable") is False:
        return ", communication not measurable under this load"
    if r["comm_exposed_ms"] is None:
        return ""
    return f", {r['comm_exposed_ms']:.1f} ms/step exposed in communication"


def _doubts(ok: list[dict], exact: list[dict], best: dict) -> list[str]:
    """Why the recommendation may not hold on a quiet machine (none: normal confidence)."""
    doubts = []
    lost = [r["name"] for r in ok if r.get("comm_measurable") is False]
    if lost:
        doubts.append(
            f"the communication time of {', '.join(lost)} was not measurable under this load "
            "(a step with communication ran faster than the same work without it, "
            "'independent': the machine's load changed between the runs)"
        )
    if min(exact, key=lambda r: r["step_ms"]["min"]) is not best:
        doubts.append("the fastest repeats rank the strategies differently from the medians")
    return doubts


def _notes(ok: list[dict], exact: list[dict], best: dict) -> list[str]:
    notes = []
    quickest = min(exact, key=lambda r: r["step_ms"]["min"])
    if quickest is not best:
        # Medians are what a run will typically see; the fastest repeat is what the machine
        # can do undisturbed. When they disagree, the load changed during the bench: say so.
        notes.append(
            f"by its fastest repeat {quickest['name']} would win "
            f"({quickest['step_ms']['min']:.1f} vs {best['step_ms']['min']:.1f} ms/step): "
            "the machine's load varied"
        )
    for r in ok:
        if not r["exact"] and r["samples_per_s"] > 1.1 * best["samples_per_s"]:
            notes.append(
                f"{r['name']} is {r['samples_per_s'] / best['samples_per_s']:.2f}x faster still but "
                f"does not compute the same update (loss after the run {r['loss']:.4f} vs "
                f"{best['loss']:.4f})"
            )
    return notes


def build(cfg, raw: dict, grad_bytes: int, parameters: int) -> dict:
    """The JSON document of one run."""
    rows = _rows(cfg, raw)
    main = raw["main"]
    return {
        "schema": SCHEMA,
        "config": {
            "model": cfg.model,
            "nproc": cfg.nproc,
            "steps": cfg.steps,
            "per_worker_batch": cfg.batch,
            "global_batch": cfg.nproc * cfg.batch,
            "repeats": cfg.repeats,
            "lr": cfg.lr,
            "local_sgd_every": cfg.local_sgd_every,
            "async_staleness": cfg.async_staleness,
        },
        "machine": {
            "device": raw["device"],
            "backend": raw["backend"],
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "loadavg_1m_before_after": raw["loadavg_1m"],
            "seconds": raw["seconds"],
            "memory_method": next(iter(main["memory_loss"].values()))["memory_method"],
        },
        "model": {"parameters": parameters, "gradient_bytes": grad_bytes},
        "strategies": rows,
        "comm": main["comm"],
        "projection": _projection(cfg, raw, rows, grad_bytes),
        "recommendation": recommend(rows),
    }


def format_table(doc: dict) -> str:
    """The terminal report: strategies, projection, validation, recommendation."""
    c = doc["config"]
    lines = [
        f"model {c['model']} ({doc['model']['parameters'] / 1e6:.2f}M parameters), "
        f"global batch {c['global_batch']}, {c['steps']} steps x {c['repeats']} repeats, "
        f"{doc['machine']['backend']} on {doc['machine']['device']} ({doc['machine']['cpus']} CPUs, "
        f"load {doc['machine']['loadavg_1m_before_after'][0]} before, "
        f"{doc['machine']['loadavg_1m_before_after'][1]} after)",
        f"{'strategy':<12} {'layout':<21} {'step ms (min-max)':>22} {'samples/s':>10} "
        f"{'speedup':>7} {'eff':>5} {'comm ms':>8} {'peak MB/rank':>13} {'loss':>8}",
    ]
    for r in doc["strategies"]:
        if not r["available"]:
            lines.append(f"{r['name']:<12} {r['reason']}")
            continue
        s = r["step_ms"]
        step = f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"
        comm = _comm_cell(r)
        peak = "/".join(f"{p:.0f}" for p in r["peak_mb"]) or "-"
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        lines.append(
            f"{r['name']:<12} {r['layout']:<21} {step:>22} {r['samples_per_s']:>10.0f} "
            f"{r['speedup']:>6.2f}x {r['scaling_efficiency']:>5.2f} {comm:>8} {peak:>13} {loss:>8}"
        )
    lost = [r["name"] for r in doc["strategies"] if r.get("comm_measurable") is False]
    if lost:
        lines.append(
            f"n/m: comm ms not measurable under this load for {', '.join(lost)} (the step ran "
            "faster than 'independent', the same work without communication)"
        )
    lines += _projection_lines(doc["projection"])
    lines.append(doc["recommendation"]["text"])
    return "\n".join(lines)


def _comm_cell(r: dict) -> str:
    if r.get("comm_measurable") is False:
        return "n/m"
    return "-" if r["comm_exposed_ms"] is None else f"{r['comm_exposed_ms']:.1f}"


def _error_words(error: float) -> str:
    """The model's relative error in words, with no sign to misread: '13% low', '2% high'."""
    if round(abs(error) * 100) == 0:
        return "within 1%"
    return f"{abs(error):.0%} {'low' if error < 0 else 'high'}"


def _projection_lines(p: dict) -> list[str]:
    net = Network.from_dict(p["network"])
    lines = [
        f"projection ({net.source} network: {net.describe()}; "
        f"{p['compute_ms_per_sample']:.4f} ms/sample, batch {p['per_rank_batch']}/rank, "
        f"{p['gradient_bytes'] / 2**20:.1f} MiB of gradients):"
    ]
    for r in p["rows"]:
        lines.append(
            f"  {r['world']:>4} ranks: step {r['step_ms']:.1f} ms (comm {r['comm_ms']:.1f}), "
            f"efficiency {r['efficiency']:.2f}, {r['samples_per_s']:.0f} samples/s"
        )
    v = p["validation"]
    if v["rows"]:
        checks = ", ".join(
            f"world {r['world']}: predicted {r['predicted_ms']:.1f} ms, measured "
            f"{r['measured_ms']:.1f} ms ({_error_words(r['error'])})"
            for r in v["rows"]
        )
        lines.append(
            f"  model check here ({v.get('strategy', REPLICATED)} step = independent + modelled "
            f"copies + all-reduce): {checks}"
        )
    if p.get("across_nodes"):
        lines += across_nodes.lines(p["across_nodes"])
    return lines
