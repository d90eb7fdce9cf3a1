"""The transformer demo (examples/gpt.py), run as the README runs it, made short."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "gpt.py")
SMALL = ["--steps", "24", "--eval-every", "12", "--n-layer", "2", "--n-embd", "32",
         "--n-head", "2", "--block-size", "32", "--max-chars", "200000",
         "--sample-chars", "80", "--lr", "3e-3"]  # fmt: skip
FINAL = re.compile(
    r"trained (\d+) steps in [\d.]+ s \| val loss ([\d.]+) -> ([\d.]+) \| "
    r"strategy (\w+), precision ([\w-]+), (\d) replica\(s\)"
)
SAMPLE = re.compile(r"--- sample ---\n(.*)\n(?:\[rank0\]: )?--- end of sample ---", re.S)


def _run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_readme_command_trains_under_zero3_and_prints_a_sample(tmp_path):
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", GPT,
           "--strategy", "zero3", "--precision", "bf16-mixed", *SMALL]  # fmt: skip
    out = _run(cmd, tmp_path)
    found = FINAL.findall(out)
    assert len(found) == 1, out  # printed once, by rank 0
    steps, first, last, strategy, precision, replicas = found[0]
    assert (steps, strategy, precision, replicas) == ("24", "zero3", "bf16-mixed", "2")
    # From about ln(vocabulary) towards character statistics: it learned something.
    assert float(first) > 4.0 and float(last) < float(first) - 0.5, out
    sample = SAMPLE.search(out)
    assert sample is not None, out
    text = sample.group(1).replace("[rank0]: ", "")
    assert text.startswith("def ") and len(text) == 4 + 80, text
    assert "[rank1]: " not in out
    # The curves, written once by rank 0: a training loss per step, validation at 0, 12, 24.
    records = [json.loads(r) for r in (tmp_path / "runs" / "gpt-logs" / "metrics.jsonl")
               .read_text().splitlines()]  # fmt: skip
    assert [r["step"] for r in records if "train/loss" in r] == list(range(24))
    val = [(r["step"], r["val/loss"]) for r in records if "val/loss" in r]
    assert [s for s, _ in val] == [0, 12, 24] and round(val[-1][1], 3) == float(last)


def test_one_process_trains_too_and_the_demo_passes_rankwise_check(tmp_path):
    out = _run([sys.executable, GPT, *SMALL, "--steps", "12"], tmp_path)
    assert FINAL.search(out).group(1, 4, 6) == ("12", "single", "1")
    done = subprocess.run([sys.executable, "-m", "rankwise", "check", GPT],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, "No pitfalls found in 1 file.")
