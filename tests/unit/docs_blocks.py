"""The code blocks of README.md and docs/*.md and what their header says about running them.

tests/unit/test_docs_run.py runs them; its docstring states the convention. This module only
reads: pages into blocks, a block's header into directives, and an `# illustrative` reason
into one of the three things this machine cannot do (or an error that says why not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)([^\n`]*)\n(.*?)^```", re.S | re.M)
DIRECTIVE = re.compile(
    r"#\s*(?P<key>illustrative|not run|launch|continues|mistake)\b\s*:?\s*(?P<value>.*?)\s*$"
)
FILE_NAME = re.compile(r"#\s*(?P<name>[\w/.-]+\.py)\s*$")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
MISTAKE_MARK = re.compile(r"#\s*(RW\d{3})\b")

# What this machine cannot do, and what the block's code must show for the reason to hold:
# `# illustrative: <reason>` is accepted for these three and nothing else.
CANNOT = {
    "GPUs": (
        re.compile(r"needs (\d+ |several )?GPUs?\b"),
        re.compile(r"cuda|nccl|gpu|device_ids=\[\d|devices=\[\d", re.I),
    ),
    "several machines": (
        re.compile(r"needs (\d+|two|three|several) (machines|hosts)\b|needs a Slurm cluster"),
        re.compile(r"--nnodes|--node[-_]rank|--master[-_]addr|\bsrun\b|\bsbatch\b|SLURM"),
    ),
    "a download": (
        re.compile(r"downloads\b"),
        re.compile(r"pip install|download|from_pretrained|git clone|\bwget\b|\bcurl\b", re.I),
    ),
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    output: str | None = None  # the ```text block right below: what the block prints
    numbers_vary: bool = False  # that ```text block's fence says `numbers-vary`

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @cached_property
    def header(self) -> dict[str, str]:
        """The directives of the block's first comment lines (an ordinary comment ends them)."""
        found: dict[str, str] = {}
        for line in self.header_lines:
            if (m := FILE_NAME.fullmatch(line.strip())) is not None:
                found["file"] = m["name"]
            elif (m := DIRECTIVE.fullmatch(line.strip())) is not None:
                found[m["key"]] = m["value"]
        return found

    @property
    def body(self) -> str:
        """The code without its header."""
        lines = self.code.lstrip().splitlines()
        return "\n".join(lines[len(self.header_lines):]) + "\n"

    @cached_property
    def header_lines(self) -> list[str]:
        out = []
        for line in self.code.lstrip().splitlines():
            if not (FILE_NAME.fullmatch(line.strip()) or DIRECTIVE.fullmatch(line.strip())):
                break
            out.append(line)
        return out

    @property
    def name(self) -> str | None:
        return self.header.get("file")

    @property
    def reason(self) -> str | None:
        """The `# illustrative: reason` marker's reason ('' when the reason is missing)."""
        return self.header.get("illustrative")

    @property
    def not_run(self) -> str | None:
        return self.header.get("not run")

    @property
    def mistake(self) -> str | None:
        return self.header.get("mistake")

    @property
    def continues(self) -> str | None:
        return self.header.get("continues")

    @property
    def launch(self) -> int | None:
        value = self.header.get("launch")
        return None if value is None else int(value) if value.isdigit() else -1


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(found):
        below = found[i + 1] if i + 1 < len(found) else None
        adjacent = below is not None and not text[m.end() : below.start()].strip()
        is_output = adjacent and below.group(1) == "text"
        out.append(Block(
            page, text[: m.start()].count("\n") + 2, m.group(1), m.group(3),
            below.group(3) if is_output else None,
            is_output and "numbers-vary" in below.group(2),
        ))
    return out


def code_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in ("python", "bash")]


def exemption(block: Block, page_blocks: list[Block]) -> str:
    """What this machine cannot do that the block needs (a key of CANNOT), or AssertionError."""
    reason = block.reason or ""
    for what, (says, shows) in CANNOT.items():
        if says.match(reason):
            named = {  # the file a command runs: the latest block above that names it
                b.name: b.body for b in page_blocks if b.name and b.line < block.line
                and re.search(rf"(?<![\w/.-]){re.escape(b.name)}\b", block.body)
            }
            evidence = block.body + "".join(named.values())
            assert shows.search(evidence), (
                f"{block.where}: `# illustrative: {reason}`: nothing in the block (or the file "
                f"it runs) needs {what} ({shows.pattern!r} not found)"
            )
            return what
    raise AssertionError(f"{block.where}: `# illustrative: {reason}` is not a reason")


GUIDE = (
    "`# illustrative:` accepts 'needs GPUs' / 'needs N GPUs', 'needs several machines' / 'needs N "
    "machines' / 'needs a Slurm cluster', 'downloads ...', and the block's code must show it. "
    "A block that needs processes gets `# launch: N`; a fragment `# continues: <file>.py` (an "
    "earlier block of the page whose first line names it); a mistake shown on purpose "
    "`# mistake: RW0NN`; a block that could run but does not, `# not run: <reason>` (counted "
    "against the figure). Minutes of running: make the block's numbers small."
)


def printed_matches(quoted: str, printed: list[str], numbers_vary: bool) -> list[str]:
    """The quoted lines (but `...`) that the printed lines do not contain."""
    wanted = [ln for ln in quoted.splitlines() if ln.strip() not in ("", "...")]
    if not numbers_vary:
        return [ln for ln in wanted if ln not in printed]
    missing = []
    for ln in wanted:
        parts = [re.escape(p) for p in NUMBER.split(ln)]
        pattern = re.compile(r"\d[\d,]*(?:\.\d+)?".join(parts))
        if not any(pattern.fullmatch(p) for p in printed):
            missing.append(ln)
    return missing
