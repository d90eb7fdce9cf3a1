"""The end-of-run summary: one row per rank (mean milliseconds per step), and the stragglers."""

from __future__ import annotations

from typing import Any

COLUMNS = ("data", "forward", "backward", "comm", "wait", "optimizer", "checkpoint", "other",
           "total")  # fmt: skip


class Totals:
    """Per-rank sums over every record (weighted by the steps each averages)."""

    def __init__(self) -> None:
        self.sums: dict[int, dict[str, float]] = {}
        self.steps: dict[int, int] = {}
        self.mem: dict[int, int | None] = {}

    def add(self, table: list[dict[str, Any]]) -> None:
        for row in table:
            r, n = row["rank"], max(1, int(row.get("steps", 1)))
            sums = self.sums.setdefault(r, dict.fromkeys(COLUMNS, 0.0))
            for c in COLUMNS:
                sums[c] += row[c] * n
            self.steps[r] = self.steps.get(r, 0) + n
            self.mem[r] = row.get("mem")

    def table(self, events: list[dict[str, Any]]) -> str:
        """The summary's text; '' when nothing was recorded."""
        if not self.sums:
            return ""
        head = f"{'rank':>4} " + " ".join(f"{c:>9}" for c in COLUMNS) + f" {'mem MiB':>8}"
        lines = [f"rankwise step anatomy (ms per step, mean over {max(self.steps.values())} "
                 "recorded steps):", head]  # fmt: skip
        for r in sorted(self.sums):
            n = self.steps[r]
            cells = " ".join(f"{self.sums[r][c] / n * 1e3:9.2f}" for c in COLUMNS)
            mem = self.mem[r]
            lines.append(f"{r:>4} {cells} {'-' if mem is None else f'{mem / 2**20:8.0f}':>8}")
        named = [e for e in events if e["event"] == "straggler"]
        if not named:
            lines.append("stragglers: none named")
        for e in named:
            lines.append(f"straggler: rank {e['rank']} (node {e['node']}), {e['kind']}, "
                         f"{e['cost_ms']:.1f} ms per step, from step {e['since_step']}")  # fmt: skip
        return "\n".join(lines)
