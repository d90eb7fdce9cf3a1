"""The strategy matrix's cases: the README's loop under every strategy, against one process.

Imported by the spawned ranks. Each case is the loop a user writes,

    model, opt, loader, sched = rt.prepare(model, opt, DataLoader(...), scheduler=sched)

with a real optimizer (SGD with momentum, Adam, AdamW with decay / no-decay groups), a plain
or an accumulating (``rt.accumulate(model, steps=2)`` + ``rt.clip_grad_norm_``) loop, a
precision policy, a scheduler given to ``prepare`` and a manual ``g["lr"]`` change at each
epoch. Its oracle is one process trained by hand with torch alone on the same global batches.
A case checks three things: the final parameters equal the oracle's; what ``rt.save`` wrote
loads into a plain module with ``rw.load_checkpoint`` and equals the run's own parameters; a
second run that resumes from the epoch-0 checkpoint (``rt.load``) ends where the
uninterrupted one ended.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

GLOBAL_BATCH = 8
SAMPLES = 32  # 4 global batches per epoch
EPOCHS = 2
TOLERANCE = {"32": 1e-5, "bf16-mixed": 2e-2, "fp16-mixed": 5e-3}
"""Largest parameter difference to the oracle. fp32: the sums of a split batch differ from one
batch's in the last bits (measured: 6e-8). bf16/fp16-mixed: each matmul rounds to 8/11
mantissa bits, so splitting a batch over ranks moves the gradients by ~1e-2 / 1e-3 relative,
and Adam turns a near-zero gradient's changed sign into a step of the full learning rate (0.01
here): measured 1.1e-2 (bf16) and 1.5e-3 (fp16) at world 2. These checks say the run followed
the oracle; the fp32 cases say the bits agree."""


def _strategies() -> list[str]:
    """Every strategy the library offers: the registry's entries (a new one joins the matrix)."""
    from rankwise.strategies import STRATEGIES

    return list(STRATEGIES)


def _init_kwargs(strategy: str) -> dict:
    """What a strategy needs from rw.init in this test: dp replicates over two CPU devices."""
    from rankwise.strategies import get

    threads = get(strategy).splits_batch_in_process
    return {"devices": ["cpu", "cpu"]} if threads else {}


@dataclass(frozen=True)
class Case:
    strategy: str
    optimizer: str
    loop: str
    precision: str
    wide: bool = False  # _net(wide=True): a bucket over the 1 MiB shared-memory threshold

    @property
    def name(self) -> str:
        net = "@wide" if self.wide else ""
        return f"{self.strategy}/{self.optimizer}{net}/{self.loop}/{self.precision}"


OPTIMIZERS = ("sgd", "adam", "adamw-groups")
LOOPS = ("plain", "accumulate")
PRECISIONS = ("32", "bf16-mixed", "fp16-mixed")
ELEMENTWISE = (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD",
    "NAdam", "RAdam",
)  # fmt: skip
"""Every torch.optim class the sharded engine accepts (per-element updates)."""


def cases(strategies: list[str], world: int) -> list[Case]:
    """The main matrix; at world 2 also every accepted optimizer class under the sharded
    strategies (the path that rebuilds the optimizer over shards)."""
    main = [Case(*c) for c in itertools.product(strategies, OPTIMIZERS, LOOPS, PRECISIONS)]
    # zero1 rebuilds the optimizer exactly as zero2 does: zero2 and zero3 cover the path.
    sharded = [s for s in strategies if s in ("zero2", "zero3")] if world > 1 else []
    extra = [Case(s, name, "plain", "32") for s in sharded for name in ELEMENTWISE]
    # Ranks that share a machine average large buckets (DDP) and stage 1's large units through
    # shared memory, small ones through Gloo: the wide net has one of each.
    wide = [Case(s, "adamw-groups", loop, "32", wide=True)
            for s in strategies for loop in LOOPS] if world > 1 else []  # fmt: skip
    return main + extra + wide


# -- model, data, optimizer: built the same way by the run and by the oracle --------------


def _net(wide: bool = False) -> nn.Module:
    torch.manual_seed(0)
    width = WIDE if wide else 12
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, width), nn.ReLU(),
                         nn.Linear(width, 3))  # fmt: skip


WIDE = 22_000
"""The wide net's last two layers: 16 x 22k parameters, 1.41 MB, the first bucket (its cap is
1 MiB) and over the 1 MiB shared-memory threshold; the first layer is a small bucket. Under
zero3 the middle layer alone (264k parameters, 1.06 MB) is a unit over the threshold."""
WIDE_SLACK = 10
"""The wide net's tolerance over the fp32 one: its last layer sums 22k products, in another
order when the batch is split (measured: 1.8e-5 under every strategy, zero2/zero3's Gloo path
included, with the accumulating loop)."""


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (SAMPLES,), generator=g))


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "adamw-groups":  # nanoGPT's configure_optimizers: decay the matrices only
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0,
             "lr": 0.02}], lr=0.01,
        )  # fmt: skip
    cls = getattr(torch.optim, name)
    return cls(params, lr=0.01) if name not in ("Adadelta",) else cls(params, lr=1.0)


def _scheduler(opt: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _manual_lr(opt: torch.optim.Optimizer, epoch: int) -> None:
    """nanoGPT sets the learning rate by hand: it must reach the optimizer that steps."""
    if epoch > 0:
        for g in opt.param_groups:
            g["lr"] = g["lr"] * 0.8


def _dtype(precision: str) -> torch.dtype | None:
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)


# -- the oracle: one process, torch only -------------------------------------------------


def oracle(case: Case) -> dict[str, torch.Tensor]:
    """One process, the global batches in order, torch's own loop for the same recipe."""
    model = _net(case.wide)
    opt = _optimizer(case.optimizer, model)
    sched = _scheduler(opt)
    dtype = _dtype(case.precision)
    scaler = torch.amp.GradScaler("cpu") if case.precision == "fp16-mixed" else None
    x_all, y_all = _data().tensors
    micro = 2 if case.loop == "accumulate" else 1
    for epoch in range(EPOCHS):
        _manual_lr(opt, epoch)
        for b in range(SAMPLES // GLOBAL_BATCH):
            x = x_all[b * GLOBAL_BATCH : (b + 1) * GLOBAL_BATCH]
            y = y_all[b * GLOBAL_BATCH : (b + 1) * GLOBAL_BATCH]
            ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
            with ctx:
                out = model(x)
            loss = F.cross_entropy(out.float(), y) / micro
            (scaler.scale(loss) if scaler else loss).backward()
            if (b + 1) % micro:
                continue
            if case.loop == "accumulate":
                if scaler:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- the run: the README's loop through rankwise ------------------------------------------


def _train(rt, case: Case, epochs: range, ckpt: str, resume: bool) -> dict[str, torch.Tensor]:
    model = _net(case.wide)
    opt = _optimizer(case.optimizer, model)
    sched = _scheduler(opt)
    batch = GLOBAL_BATCH // rt.world_size
    with contextlib.redirect_stderr(io.StringIO()):
        model, opt, loader, sched = rt.prepare(
            model, opt, DataLoader(_data(), batch_size=batch), scheduler=sched
        )
    SHARED[case.name] = _in_shared_memory(model)
    if resume:
        rt.load(ckpt, model=model, optimizer=opt, loader=loader)
    for epoch in epochs:
        loader.set_epoch(epoch)
        _manual_lr(opt, epoch)
        for x, y in loader:
            if case.loop == "plain":
                loss = F.cross_entropy(model(x), y)
                rt.backward(loss)
                opt.step()
                opt.zero_grad()
                sched.step()
                continue
            with rt.accumulate(model, steps=2) as acc:
                rt.backward(F.cross_entropy(model(x), y))
                if acc.sync:
                    rt.clip_grad_norm_(model, 0.5)
                    opt.step()
                    opt.zero_grad()
                    sched.step()
        if epoch == 0 and not resume:
            rt.save(ckpt, model=model, optimizer=opt, loader=loader, epoch=epoch)
    final = os.path.join(os.path.dirname(ckpt), "final.pt")
    rt.save(final, model=model, optimizer=opt)
    saved = _net(case.wide)
    rw.load_checkpoint(final, model=saved)  # into a plain module
    return {k: v.detach().clone() for k, v in saved.state_dict().items()}


SHARED: dict[str, bool] = {}
"""Case name -> whether its prepared model averaged something through shared memory."""


def _in_shared_memory(model: nn.Module) -> bool:
    """DDP with a bucket in shared memory, ZeRO stage 1 with a unit there, or stage 3 with
    its units there (``comm/node_shared``)."""
    reducer = getattr(model, "reducer", None)
    if reducer is not None:
        return reducer.shared is not None
    units = getattr(model, "units", ())
    return any(u.shared is not None or u.node is not None for u in units)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def run_case(case: Case, workdir: str) -> dict:
    """One case on this rank: differences to the oracle and to the uninterrupted run."""
    ckpt = os.path.join(workdir, case.name.replace("/", "_"), "epoch0.pt")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)
    runs = []
    for epochs, resume in ((range(EPOCHS), False), (range(1, EPOCHS), True)):
        # A new session per run, as a restarted job has (one scheduler, one loss scale).
        kwargs = _init_kwargs(case.strategy)
        rt = rw.init(strategy=case.strategy, precision=case.precision, **kwargs)
        runs.append(_train(rt, case, epochs, ckpt, resume=resume))
        rw.shutdown()
    whole, resumed = runs
    want = oracle(case)
    return {
        "oracle": _diff(whole, want),
        "resume": _diff(resumed, whole),
        "finite": all(torch.isfinite(v).all().item() for v in whole.values()),
        "tolerance": TOLERANCE[case.precision] * (WIDE_SLACK if case.wide else 1),
        "shared_memory": SHARED.get(case.name),
    }


def run_matrix(world: int, workdir: str) -> dict[str, dict | str]:
    """Every case whose strategy runs at this world size, in one process; rw.init per
    strategy (a strategy that refuses this world size is recorded as such)."""
    torch.set_num_threads(1)  # tiny tensors: a thread pool per rank only contends
    results: dict[str, dict | str] = {}
    everything = sorted(cases(_strategies(), world), key=lambda c: c.strategy)
    for strategy, group in itertools.groupby(everything, key=lambda c: c.strategy):
        try:
            rw.init(strategy=strategy, **_init_kwargs(strategy))
        except rw.ConfigError as exc:  # 'single'/'dp' run one process: not at world 2
            results[strategy] = f"refused at world {world}: {str(exc).splitlines()[0]}"
            continue
        rw.shutdown()
        for case in group:
            try:
                results[case.name] = run_case(case, workdir)
            except Exception:  # reported by the test, with the traceback
                results[case.name] = traceback.format_exc()
            rw.shutdown()
    return results


def failures(results: dict[str, dict | str]) -> list[str]:
    """What went wrong, one line per case (strategies refused at a world size are not)."""
    bad = []
    for name, r in results.items():
        if isinstance(r, str):
            if not r.startswith("refused at world"):
                bad.append(f"{name}: {r}")
            continue
        if not r["finite"] or not r["oracle"] <= r["tolerance"] or not math.isfinite(r["oracle"]):
            bad.append(f"{name}: differs from the oracle by {r['oracle']:.3g} > {r['tolerance']}")
        if not r["resume"] <= 1e-6:
            bad.append(f"{name}: resumed run differs from the uninterrupted one by {r['resume']:.3g}")
    return bad
