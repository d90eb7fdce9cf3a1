"""Which conditions select a subset of ranks: ``if rank == 0``, ``if rt.is_master``, ...

``polarity(test)`` is +1 when the test is true only on rank 0 (or the local master), -1 when it
is true only on the other ranks, and 0 when it says nothing about ranks. Unknown shapes are 0:
a guard we do not recognise makes the checker quieter, never louder.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from .astutil import dotted, last_name

if TYPE_CHECKING:
    from .facts import ScriptFacts

MASTER_WORDS = frozenset(
    {
        "is_master",
        "master",
        "is_main",
        "main_process",
        "is_main_process",
        "master_process",
        "is_master_process",
        "is_rank_zero",
        "is_rank0",
        "rank0",
        "rank_zero",
        "is_global_zero",
        "is_local_master",
        "is_local_main_process",
        "is_world_process_zero",
        "is_local_process_zero",
        "is_primary",
        "is_chief",
        "is_root",
        "is_leader",
    }
)
RANK_CALLS = frozenset({"get_rank", "get_local_rank", "get_global_rank", "get_ordinal", "rank"})
RANK_ENV = frozenset(
    {"RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}
)
# `node_rank == 0` still runs on every local rank of node 0, and `num_ranks` is a size.
NOT_A_RANK = frozenset({"node", "num", "n", "size", "count", "ranks", "world_size"})


def _is_env_rank_key(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in RANK_ENV


def is_rank_expr(e: ast.AST, script: ScriptFacts | None = None, follow: bool = True) -> bool:
    """Does ``e`` evaluate to this process's rank (global or local)?

    With ``script``, a parameter that holds a rank (``ranksource``: ``main(rank)`` started by
    ``mp.spawn``, ``Trainer(gpu_id=rank)``) counts, and (``follow``) so does a variable whose
    every assignment is a rank (``self.gpu_id = int(os.environ["LOCAL_RANK"])``).
    """
    if isinstance(e, ast.Call):
        name = last_name(e.func)
        if name in ("int", "str") and e.args:
            return is_rank_expr(e.args[0], script, follow)
        if name in ("get", "getenv") and e.args:  # os.environ.get("RANK"), os.getenv("RANK")
            return _is_env_rank_key(e.args[0])
        return name in RANK_CALLS
    if isinstance(e, ast.Subscript):  # os.environ["LOCAL_RANK"]
        return _is_env_rank_key(e.slice)
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mod):  # args.rank % ngpus == 0
        return is_rank_expr(e.left, script, follow)
    name = last_name(e)
    if name is None:
        return False
    tokens = set(name.lower().split("_"))
    if ("rank" in tokens and not tokens & NOT_A_RANK) or name.endswith("process_index"):
        return True
    if script is None:
        return False
    if isinstance(e, ast.Name) and e.id in script.rank_params.get(script.scope_of.get(e), ()):
        return True
    bound = script.bindings.get(dotted(e) or "", []) if follow else []
    return bool(bound) and all(is_rank_expr(b.value, script, follow=False) for b in bound)


def _is_pid(e: ast.AST) -> bool:
    return isinstance(e, ast.Call) and last_name(e.func) == "getpid"


def mentions_rank(e: ast.AST, script: ScriptFacts | None = None) -> bool:
    """Does ``e`` use the rank, or the process id, to tell processes apart?"""
    return any(is_rank_expr(n, script) or _is_pid(n) for n in ast.walk(e))


def _const(e: ast.AST) -> object:
    if isinstance(e, ast.Constant) and not isinstance(e.value, bool):
        return (
            int(e.value) if isinstance(e.value, str) and e.value.lstrip("-").isdigit() else e.value
        )
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        inner = _const(e.operand)
        return -inner if isinstance(inner, int) else None
    return None


_FLIP = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE}


def _compare(op: ast.cmpop, value: ast.AST) -> int:
    """Polarity of ``rank <op> value``."""
    if isinstance(op, ast.In | ast.NotIn) and isinstance(value, ast.List | ast.Tuple | ast.Set):
        consts = {_const(v) for v in value.elts}
        p = 1 if 0 in consts and consts <= {0, -1} else 0
        return p if isinstance(op, ast.In) else -p
    c = _const(value)
    if not isinstance(c, int):
        return 0
    table = {
        (ast.Eq, 0): 1,
        (ast.NotEq, 0): -1,
        (ast.LtE, 0): 1,
        (ast.Lt, 1): 1,
        (ast.Gt, 0): -1,
        (ast.GtE, 1): -1,
    }
    return table.get((type(op), c), 0)


def _not_distributed(e: ast.AST) -> bool:
    """``not args.distributed``, ``not dist.is_initialized()``, ``world_size == 1``."""
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        text = ast.unparse(e.operand).lower()
        # `not args.multiprocessing_distributed` says how the workers were started (mp.spawn
        # or not), not that there is one process: under torchrun it is True on every rank.
        if "multiprocessing" in text:
            return False
        return any(w in text for w in ("distributed", "is_initialized", "ddp"))
    if isinstance(e, ast.Compare) and len(e.ops) == 1:
        name = (last_name(e.left) or "").lower()
        c = _const(e.comparators[0])
        one = (isinstance(e.ops[0], ast.Eq | ast.LtE) and c == 1) or (
            isinstance(e.ops[0], ast.Lt) and c == 2
        )
        return one and ("world_size" in name or "gpu" in name)
    return False


def polarity(e: ast.AST, script: ScriptFacts | None = None, depth: int = 1) -> int:
    """+1: true only on rank 0; -1: true only on the other ranks; 0: unknown."""
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
        if is_rank_expr(e.operand, script):  # `not rank`
            return 1
        return -polarity(e.operand, script, depth)
    if isinstance(e, ast.Compare) and len(e.ops) == 1:
        left, op, right = e.left, e.ops[0], e.comparators[0]
        if is_rank_expr(left, script):
            return _compare(op, right)
        if is_rank_expr(right, script) and type(op) in (*_FLIP, ast.Eq, ast.NotEq):
            return _compare(_FLIP.get(type(op), type(op))(), left)
        return 0
    if isinstance(e, ast.BoolOp):
        ps = [polarity(v, script, depth) for v in e.values]
        if isinstance(e.op, ast.And):
            nonzero = {p for p in ps if p}
            return nonzero.pop() if len(nonzero) == 1 else 0
        ok = all(p == 1 or _not_distributed(v) for p, v in zip(ps, e.values, strict=True))
        return 1 if ok and 1 in ps else 0
    if isinstance(e, ast.Call):
        return 1 if last_name(e.func) in MASTER_WORDS else 0
    name = last_name(e)
    if name is None:
        return 0
    if name.lower() in MASTER_WORDS:
        return 1
    if is_rank_expr(e, script):  # `if rank:` is true on every rank but 0
        return -1
    if script is not None and depth > 0 and dotted(e):  # master = rank == 0; if master: ...
        found = {polarity(b.value, script, depth - 1) for b in script.bindings.get(dotted(e), [])}
        return found.pop() if len(found) == 1 else 0
    return 0


GLOBAL_RANK_ENV = frozenset({"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"})
LOCAL_RANK_ENV = frozenset({"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"})


def _env_kind(key: ast.AST) -> str | None:
    if isinstance(key, ast.Constant):
        if key.value in GLOBAL_RANK_ENV:
            return "global"
        if key.value in LOCAL_RANK_ENV:
            return "local"
    return None


def rank_kind(e: ast.AST, script: ScriptFacts | None = None, depth: int = 2) -> str | None:
    """``"global"`` (RANK, ``dist.get_rank()``), ``"local"`` (LOCAL_RANK, ``args.local_rank``)
    or None (not a rank, or a rank of unknown kind such as an ``mp.spawn`` index).

    Variables are judged by what they were assigned (``rank = int(os.environ["RANK"])``);
    only ``*local_rank*`` is judged by its name, because its meaning is the same everywhere.
    """
    if isinstance(e, ast.Call):
        name = last_name(e.func)
        if name in ("int", "str") and e.args:
            return rank_kind(e.args[0], script, depth)
        if name in ("get", "getenv") and e.args:
            return _env_kind(e.args[0])
        return {"get_rank": "global", "get_global_rank": "global", "get_local_rank": "local"}.get(
            name or ""
        )
    if isinstance(e, ast.Subscript):
        return _env_kind(e.slice)
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mod) and _per_node(e.right):
        # args.rank % ngpus_per_node: the rank within its node (imagenet/main.py's save guard)
        return "local" if is_rank_expr(e.left, script) else None
    name = last_name(e)
    if name is None:
        return None
    tokens = set(name.lower().split("_"))
    if {"local", "rank"} <= tokens:
        return "local"
    bound = script.bindings.get(dotted(e) or "", []) if script is not None and depth else []
    kinds = {rank_kind(b.value, script, depth - 1) for b in bound}
    return kinds.pop() if len(kinds) == 1 else None


def _per_node(e: ast.AST) -> bool:
    """A count of processes per node: ``ngpus_per_node``, ``local_world_size``, ``device_count()``."""
    if isinstance(e, ast.Call):
        return last_name(e.func) == "device_count"
    name = (last_name(e) or "").lower()
    return "per_node" in name or "local_world_size" in name or name == "nproc"


def once_per_node(test: ast.AST, script: ScriptFacts) -> ast.AST | None:
    """The term of ``test`` true on local rank 0 of every node (``local_rank == 0``,
    ``args.rank % ngpus_per_node == 0``), unless ``test`` also requires global rank 0."""
    found = None
    for n in ast.walk(test):
        if not (isinstance(n, ast.Compare) and len(n.ops) == 1 and polarity(n, script) == 1):
            continue
        kinds = {rank_kind(n.left, script), rank_kind(n.comparators[0], script)} - {None}
        if kinds == {"global"}:
            return None
        if kinds == {"local"}:
            found = found or n
    return found


def kinds_in(e: ast.AST, script: ScriptFacts, depth: int = 1) -> set[str]:
    """The kinds of every rank ``e`` reads, through the variables it names (``master``)."""
    out: set[str] = set()
    for n in ast.walk(e):
        k = rank_kind(n, script)
        if k is not None:
            out.add(k)
        elif depth and isinstance(n, ast.Name | ast.Attribute) and dotted(n):
            for b in script.bindings.get(dotted(n) or "", []):
                out |= kinds_in(b.value, script, depth - 1)
    return out
