"""The README's demo, run as a user runs it: `rankwise run` and plain `python`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")
FINAL = re.compile(
    r"test accuracy (\d\.\d{4}) \((\d+)/360\) \| throughput ([\d,]+) samples/s \| "
    r"strategy (\w+), (\d) replica\(s\), epochs (\d+)-(\d+) in [\d.]+ s"
)


def _run(cmd: list[str], cwd: Path, stderr: list[str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    if stderr is not None:
        stderr.append(done.stderr)
    return done.stdout


def test_readme_command_trains_to_95_percent_with_two_processes(tmp_path):
    # The README's first command, minus the install: two processes, default settings.
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", DIGITS]
    err: list[str] = []
    out = _run([*cmd, "--ckpt", str(tmp_path / "ckpt")], tmp_path, err)
    found = FINAL.findall(out)
    assert len(found) == 1, out  # printed once, by rank 0
    acc, correct, throughput, strategy, replicas, first, last = found[0]
    assert float(acc) >= 0.95 and round(int(correct) / 360, 4) == float(acc)
    assert int(throughput.replace(",", "")) > 0
    assert (strategy, replicas, first, last) == ("ddp", "2", "0", "7")
    assert "[rank0]: " in out and "[rank1]: test accuracy" not in out
    assert "[rank1]: " not in out + err[0], err  # rank 1 says nothing, not even at exit
    # The README's sample: each epoch's progress lines end at 100% before its result line.
    mine = [line for line in out.splitlines() if line.startswith("[rank0]: epoch")]
    epochs = [int(line.split()[2].rstrip(":")) for line in mine]
    assert epochs == sorted(epochs) and set(epochs) == set(range(8)), mine
    for e in range(8):
        last_two = [line for line in mine if line.startswith(f"[rank0]: epoch {e}:")][-2:]
        assert "100%" in last_two[0] and "train loss" in last_two[1], last_two
    assert len(list((tmp_path / "ckpt").glob("ckpt-*.pt"))) == 3  # saved every epoch, keep 3
    # The curves, written once (rank 0): 8 epoch records, the last accuracy the one printed.
    records = (tmp_path / "runs" / "digits-logs" / "metrics.jsonl").read_text().splitlines()
    epochs = [json.loads(r) for r in records if "epoch/test_accuracy" in r]
    assert [e["step"] for e in epochs] == list(range(8))
    assert round(epochs[-1]["epoch/test_accuracy"], 4) == float(acc)


def test_plain_python_then_resume_under_dataparallel(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = _run([sys.executable, DIGITS, "--epochs", "1", "--ckpt", ckpt], tmp_path)
    assert FINAL.search(first).group(4, 5, 6, 7) == ("single", "1", "0", "0")
    # The checkpoint holds the bare model and the data position: another strategy resumes it.
    dp = ["--strategy", "dp", "--devices", "cpu,cpu"]
    second = _run(
        [sys.executable, DIGITS, *dp, "--epochs", "2", "--resume", "--ckpt", ckpt], tmp_path
    )
    assert f"resumed from {ckpt} after epoch 0" in second
    assert FINAL.search(second).group(4, 5, 6, 7) == ("dp", "2", "1", "1")


def test_the_demo_passes_rankwise_check(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rankwise", "check", DIGITS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "No pitfalls found in 1 file."), (
        done.stderr
    )
