"""The one-call loop under a pipeline mesh: ``rw.init(mesh={"pipeline": P, ...})`` +
``rt.prepare(GPT, AdamW, DataLoader)`` cuts ``rankwise.models.GPT`` (blocks in a ModuleList,
head tied to the embedding) into stages, and ``logits, loss = model(x, y); rt.backward(loss);
opt.step()`` trains what one process trains: parameters after a few AdamW steps (two
parameter groups) equal to 1e-6 under every schedule, the tied copies equal, the loss the same
on every rank and the one ``rt.log``/``rt.print`` report, the checkpoint ``rt.save`` writes the
one-process model and optimizer (it loads into a plain process, and back into a pipeline).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.models import GPT
from rankwise.models.gpt import GPTConfig, param_groups
from rankwise.testing import run_distributed

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
STEPS, BATCH, TOL = 3, 8, 1e-6
PARAM_TOL = 5e-6
"""Parameters after STEPS AdamW steps: AdamW divides each element's update by its gradient's
RMS, so where an element's gradients nearly cancel between steps, the last bits in which the
pipeline's gradient differs (micro-batches summed, not one batch) grow to ~2e-6
(blocks.2.mlp.0.weight under GPipe); losses, logits and optimizer state are held to TOL."""
SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved_1f1b", 2), ("zero_bubble", 1),
             ("zero_bubble", 2)]  # fmt: skip


def _data(cfg: GPTConfig = CFG, global_batch: int = BATCH) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    n = global_batch * STEPS
    ids = torch.randint(0, cfg.vocab_size, (n, cfg.block_size), generator=g)
    return TensorDataset(ids, torch.randint(0, cfg.vocab_size, (n, cfg.block_size), generator=g))


def _gpt(cfg: GPTConfig = CFG) -> tuple[GPT, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = GPT(cfg)
    return model, torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)


def _oracle(cfg: GPTConfig = CFG, global_batch: int = BATCH, clip: float | None = None,
            autocast: torch.dtype | None = None):  # fmt: skip
    """One process on the same global batches, torch alone: (state, optimizer state, losses).
    ``autocast``: the forward (the loss inside it) under CPU autocast to that dtype."""
    model, opt = _gpt(cfg)
    losses = []
    for x, y in DataLoader(_data(cfg, global_batch), batch_size=global_batch):
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            _, loss = model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), opt.state_dict(), losses


def _worst(got: dict, want: dict) -> float:
    return max((torch.as_tensor(v) - want[k]).abs().max().item() for k, v in got.items())


def _loop(rt, schedule: str, v: int | None, ckpt: str | None = None) -> dict:
    """The README loop on a pipeline: returns this rank's state and what it saw."""
    model, opt = _gpt()
    loader = DataLoader(_data(), batch_size=BATCH // rt.mesh.sizes["data"])
    model, opt, loader = rt.prepare(model, opt, loader, pipeline_schedule=schedule,
                                    stages_per_rank=v, microbatches=4)  # fmt: skip
    losses, printed = [], io.StringIO()
    for x, y in loader:
        logits, loss = model(x, y)
        rt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        rt.log({"loss": loss}, reduce="mean")
        with contextlib.redirect_stdout(printed):
            rt.print(f"loss {loss.item():.6f}")
    if ckpt is not None:
        rt.save(ckpt, model=model, optimizer=opt, step=STEPS)
    bare = rw.checkpoint.state_dict.model_state(model)
    return {"state": {k: t.numpy().copy() for k, t in bare.items()}, "losses": losses,
            "logits": logits, "printed": printed.getvalue()}  # fmt: skip


def _every_schedule(tmp: str) -> dict:
    rt = rw.init(mesh={"pipeline": 2}, timeout=200)
    rt.log_to(f"{tmp}/logs")
    out = {}
    for schedule, v in SCHEDULES:
        last = schedule == SCHEDULES[-1][0] and v == SCHEDULES[-1][1]
        out[f"{schedule}/{v}"] = _loop(rt, schedule, v, f"{tmp}/ckpt" if last else None)
    return {"schedules": out, "evaluation": _evaluation(rt)}


def _evaluation(rt) -> dict:
    """Forwards only under no_grad; a training call never backpropagated leaves no gradient."""
    model, opt = _gpt()
    model, opt = rt.prepare(model, opt, microbatches=3)
    x, y = next(iter(DataLoader(_data(), batch_size=BATCH)))
    with torch.no_grad():
        logits, loss = model(x, y)
    _, unused = model(x, y)  # no rt.backward: the step's gradients are dropped
    grads = [p.grad for p in model.parameters()]
    return {"logits": None if logits is None else logits.numpy(), "loss": loss.item(),
            "unused": unused.item(), "no_grads": all(g is None for g in grads)}  # fmt: skip


def test_gpt_with_a_tied_head_trains_under_every_schedule_as_one_process(tmp_path: Path):
    jobs = run_distributed(_every_schedule, 2, args=(str(tmp_path),), init=False, timeout=300)
    results = [job["schedules"] for job in jobs]
    want, want_opt, want_losses = _oracle()
    for key in results[0]:
        first, last = results[0][key], results[1][key]
        worst = max(_worst(first["state"], want), _worst(last["state"], want))
        assert worst <= PARAM_TOL, (key, worst)
        assert set(first["state"]) | set(last["state"]) == set(want)
        # The head tied to the embedding: one copy per end, kept equal.
        assert "wte.weight" in first["state"] and "lm_head.weight" in last["state"]
        assert (first["state"]["wte.weight"] == last["state"]["lm_head.weight"]).all()
        assert first["losses"] == last["losses"]  # the last stage's loss, on every rank
        assert max(abs(a - b) for a, b in zip(first["losses"], want_losses, strict=True)) <= TOL
        assert first["logits"] is None and last["logits"] is None  # not kept (memory)
        assert first["printed"].split() == [w for x in first["losses"] for w in ("loss", f"{x:.6f}")]
    _check_evaluation([job["evaluation"] for job in jobs])
    logged = [json.loads(line)["loss"] for line in (tmp_path / "logs/metrics.jsonl").open()]
    assert logged == [x for key in results[0] for x in results[0][key]["losses"]]
    # The consolidated checkpoint is the one-process model and AdamW state.
    ckpt = torch.load(next((tmp_path / "ckpt").glob("ckpt-*.pt")), weights_only=True)
    assert set(ckpt["model"]) == set(want) and _worst(ckpt["model"], want) <= PARAM_TOL
    plain, opt = _gpt()
    info = rw.load_checkpoint(tmp_path / "ckpt", model=plain, optimizer=opt)
    assert info["step"] == STEPS and _worst(plain.state_dict(), want) <= PARAM_TOL
    for k, state in want_opt["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert (opt.state_dict()["state"][k][name] - state[name]).abs().max() <= TOL, (k, name)


def _check_evaluation(evals: list[dict]) -> None:
    model, _ = _gpt()
    x, y = next(iter(DataLoader(_data(), batch_size=BATCH)))
    with torch.no_grad():
        logits, loss = model(x, y)
    first, last = evals
    assert first["logits"] is None and (torch.as_tensor(last["logits"]) - logits).abs().max() <= TOL
    for e in evals:  # the loss on every rank, the training call's too; no gradient kept
        assert abs(e["loss"] - loss.item()) <= TOL and abs(e["unused"] - loss.item()) <= TOL
        assert e["no_grads"]


def _accumulate_clip_resume(tmp: str) -> dict:
    """Half batches, two per optimizer step under rt.accumulate, clipped; then a resume."""
    rt = rw.init(mesh={"pipeline": 2}, timeout=200)
    model, opt = _gpt()
    loader = DataLoader(_data(), batch_size=BATCH // 2)
    model, opt, loader = rt.prepare(model, opt, loader, microbatches=2)
    norms = []
    for k, (x, y) in enumerate(loader):
        with rt.accumulate(model, steps=2) as acc:
            _, loss = model(x, y)
            rt.backward(loss)
            if acc.sync:
                norms.append(rt.clip_grad_norm_(model, 0.5).item())
                opt.step()
                opt.zero_grad()
        if k == 3:
            rt.save(f"{tmp}/resume", model=model, optimizer=opt, step=2)
    state = {k: t.numpy().copy() for k, t in rw.checkpoint.state_dict.model_state(model).items()}
    # A fresh pipeline loads step 2 and takes step 3 again: the same parameters.
    again, opt2 = _gpt()
    again, opt2 = rt.prepare(again, opt2, microbatches=2)
    rt.load(f"{tmp}/resume", model=again, optimizer=opt2)
    for x, y in list(DataLoader(_data(), batch_size=BATCH))[2:]:
        _, loss = again(x, y)
        rt.backward(loss)
        rt.clip_grad_norm_(again, 0.5)
        opt2.step()
        opt2.zero_grad()
    resumed = rw.checkpoint.state_dict.model_state(again)
    return {"state": state, "norms": norms, "resumed": {k: t.numpy() for k, t in resumed.items()}}


def test_accumulation_clipping_and_resume_under_a_pipeline(tmp_path: Path):
    results = run_distributed(_accumulate_clip_resume, 2, args=(str(tmp_path),), init=False,
                              timeout=300)  # fmt: skip
    want, _, _ = _oracle(clip=0.5)
    for r in results:
        assert _worst(r["state"], want) <= PARAM_TOL and _worst(r["resumed"], want) <= PARAM_TOL
    assert results[0]["norms"] == results[1]["norms"]  # the global norm on every rank
    assert min(results[0]["norms"]) > 0.5  # every step was clipped


def _train(rt, model, opt, loader, schedule: str, v: int | None) -> tuple[object, list[float]]:
    """The README loop, prepared for a pipeline of 4 micro-batches: the model and its losses."""
    model, opt, loader = rt.prepare(model, opt, loader, pipeline_schedule=schedule,
                                    stages_per_rank=v, microbatches=4)  # fmt: skip
    losses = []
    for x, y in loader:
        _, loss = model(x, y)
        rt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def _mesh_run(mesh: dict, strategy: str, schedule: str, v: int | None, cfg: GPTConfig) -> dict:
    rt = rw.init(mesh=mesh, strategy=strategy, timeout=300)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    loader = DataLoader(_data(cfg, 2 * BATCH), batch_size=2 * BATCH // rt.mesh.sizes["data"])
    model, losses = _train(rt, model, opt, loader, schedule, v)
    state = rw.checkpoint.state_dict.model_state(model)
    refused = ""
    if strategy.startswith("zero"):
        state = model.state_dict()  # the engine's: consolidated over the data group
        try:
            rt.clip_grad_norm_(model, 1.0)
        except rw.ConfigError as exc:
            refused = str(exc)
    return {"state": {k: t.numpy().copy() for k, t in state.items()}, "losses": losses,
            "clip_refused": refused}  # fmt: skip


MESH_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=8, n_head=2, n_embd=16)
MESH_CASES = {
    "pipeline4-1f1b": ({"pipeline": 4}, "ddp", "1f1b", None),
    "pipeline4-zb-v2": ({"pipeline": 4}, "ddp", "zero_bubble", 2),
    "pipeline2-data2-ddp-interleaved": ({"pipeline": 2, "data": 2}, "ddp", "interleaved_1f1b", 2),
    "pipeline2-data2-zero2-zb": ({"pipeline": 2, "data": 2}, "zero2", "zero_bubble", 1),
}


def _in_turn(run, cases: dict) -> dict:
    """Each case in turn in one job, the runtime shut down between them: the ranks start once
    (each start imports torch: seconds of CPU per rank) instead of once per case."""
    out = {}
    for name, args in cases.items():
        try:
            out[name] = run(*args)
        except Exception as exc:
            raise RuntimeError(f"case {name} failed") from exc
        rw.shutdown()
    return out


@pytest.fixture(scope="module")
def mesh_runs() -> list[dict]:
    cases = {name: (*case, MESH_CFG) for name, case in MESH_CASES.items()}
    return run_distributed(_in_turn, 4, args=(_mesh_run, cases), init=False, timeout=1500)


@pytest.mark.slow  # 4 ranks
@pytest.mark.timeout(1600)  # the first test waits for the shared job
@pytest.mark.parametrize("case", list(MESH_CASES))
def test_gpt_on_4_ranks_equals_one_process(mesh_runs, case):
    mesh, strategy, _, _ = MESH_CASES[case]
    results = [by_case[case] for by_case in mesh_runs]
    want, _, want_losses = _oracle(MESH_CFG, 2 * BATCH)
    held = set()
    data = mesh.get("data", 1)
    for rank, r in enumerate(results):
        assert _worst(r["state"], want) <= PARAM_TOL, rank
        held |= set(r["state"])
    assert held == set(want)
    if strategy.startswith("zero"):  # each stage's engine knows its own shards' norm only
        assert all("strategy='ddp'" in r["clip_refused"] for r in results)
    # Ranks 0..data-1 are the first stage of each replica: their mean is the global batch's.
    per_replica = [results[d]["losses"] for d in range(data)]
    mean = [sum(x) / data for x in zip(*per_replica, strict=True)]
    assert max(abs(a - b) for a, b in zip(mean, want_losses, strict=True)) < 1e-5


def test_a_model_without_blocks_or_with_a_bad_option_is_refused_by_name():
    errors = run_distributed(_refusals, 2, init=False, timeout=120)[0]
    assert "'pipedream'" in errors[0] and "'1f1b'" in errors[0]
    assert "microbatches=0" in errors[1]
    assert "Module" in errors[2] and "ModuleList" in errors[2]
    assert "meta device" in errors[3] and "pipeline" in errors[3]  # the cause and the mesh
    assert "without torch.device('meta')" in errors[3]  # the fix


def _refusals() -> list[str]:
    rt = rw.init(mesh={"pipeline": 2})
    errors = []
    for kwargs in ({"pipeline_schedule": "pipedream"}, {"microbatches": 0}):
        model, opt = _gpt()
        try:
            rt.prepare(model, opt, **kwargs)
        except rw.ConfigError as exc:
            errors.append(str(exc))
    flat = torch.nn.Module()
    flat.fc = torch.nn.Linear(3, 3)
    try:
        rt.prepare(flat)
    except rw.ConfigError as exc:
        errors.append(str(exc))
    with torch.device("meta"):  # deferred init is for data and tensor dimensions only
        meta = GPT(CFG)
    try:
        rt.prepare(meta)
    except rw.ConfigError as exc:
        errors.append(str(exc))
    return errors


def _sequential_with_loss_fn() -> dict:
    rt = rw.init(mesh={"pipeline": 2})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                              torch.nn.Tanh(), torch.nn.Linear(16, 3))  # fmt: skip
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = rt.prepare(net, opt, loss_fn=F.cross_entropy, microbatches=3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)
    loss = net(x, y)
    rt.backward(loss)
    opt.step()
    return {k: t.numpy() for k, t in rw.checkpoint.state_dict.model_state(net).items()}


@pytest.mark.slow  # ~65 s on the loaded 2-core machine
def test_an_nn_sequential_trains_with_loss_fn():
    results = run_distributed(_sequential_with_loss_fn, 2, init=False, timeout=120)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                              torch.nn.Tanh(), torch.nn.Linear(16, 3))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)
    F.cross_entropy(net(x), y).backward()
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    got = {**results[0], **results[1]}
    assert set(got) == set(net.state_dict()) and _worst(got, net.state_dict()) <= PARAM_TOL


def _tensor_stages(schedule: str, tmp: str) -> dict:
    import mesh_cases as mc

    from rankwise.models import GPT as TinyGPT
    from rankwise.models import GPT_PLAN
    from rankwise.parallel import tensor as tp

    rt = rw.init(mesh={"pipeline": 2, "tensor": 2}, timeout=300)
    tensor = rt.mesh.group("tensor")
    torch.manual_seed(0)
    model = rw.tensor_parallel(TinyGPT(mc.CFG), GPT_PLAN, group=tensor)  # head tied to wte
    opt = mc.adamw(model.parameters())
    model, opt = rt.prepare(model, opt, pipeline_schedule=schedule, microbatches=2,
                            loss_fn=lambda out, t: rw.vocab_parallel_cross_entropy(out[0], t, tensor))
    for x, y in mc.batches(4):
        loss = model(x, y)
        rt.backward(loss)
        opt.step()
        opt.zero_grad()
    try:
        rt.save(os.path.join(tmp, "unused-ckpt"), model=model, optimizer=opt)  # never the cwd
    except rw.ConfigError as exc:
        assert "tensor-parallel" in str(exc)
    else:
        raise AssertionError("rt.save of a tensor-parallel pipeline was not refused")
    return {k: v.numpy() for k, v in tp.full_state_dict(model).items()}


TENSOR_SCHEDULES = ["1f1b", "zero_bubble"]


@pytest.fixture(scope="module")
def tensor_stage_runs(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("tensor-stages"))
    cases = {schedule: (schedule, tmp) for schedule in TENSOR_SCHEDULES}
    return run_distributed(_in_turn, 4, args=(_tensor_stages, cases), init=False, timeout=800)


@pytest.mark.slow  # 4 ranks
@pytest.mark.timeout(900)  # the first test waits for the shared job
@pytest.mark.parametrize("schedule", TENSOR_SCHEDULES)
def test_tensor_parallel_gpt_with_a_tied_head_on_pipeline_2_by_tensor_2(schedule, tensor_stage_runs):
    import mesh_cases as mc

    from rankwise.models import GPT as TinyGPT

    results = [by_schedule[schedule] for by_schedule in tensor_stage_runs]
    torch.manual_seed(0)
    model = TinyGPT(mc.CFG)
    opt = mc.adamw(model.parameters())
    for x, y in mc.batches(4):
        F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    want = model.state_dict()
    assert set(results[0]) | set(results[2]) == set(want)
    for rank, state in enumerate(results):  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
        assert _worst(state, want) <= mc.TOL, rank


def _freeze_schedule(model, step: int) -> None:
    """Block 1 frozen for the first step, then unfrozen (what a fine-tuning script does between
    steps, after ``rt.prepare``: by name, since a pipeline rank holds only its stages' blocks).
    Freezing a trained layer after ``rt.prepare`` is refused as under DDP (a parameter without
    a gradient), so only unfreezing is tried here."""
    for name, p in model.named_parameters():
        if name.startswith("blocks.1."):
            p.requires_grad_(step > 0)



def _refreezing(schedule: str, v: int | None) -> dict:
    rt = rw.init(mesh={"pipeline": 2}, timeout=200)
    out = {}
    for schedule, v in (("1f1b", None), ("zero_bubble", 1)):
        net, opt = _gpt()
        _freeze_schedule(net, 0)
        loader = DataLoader(_data(), batch_size=BATCH)
        model, opt, loader = rt.prepare(net, opt, loader, pipeline_schedule=schedule,
                                        stages_per_rank=v, microbatches=4)  # fmt: skip
        for step, (x, y) in enumerate(loader):
            _freeze_schedule(net, step)
            _, loss = model(x, y)
            rt.backward(loss)
            opt.step()
            opt.zero_grad()
        bare = rw.checkpoint.state_dict.model_state(model)
        out[schedule] = {k: t.numpy().copy() for k, t in bare.items()}
    return out


def test_a_block_unfrozen_after_prepare_trains_as_in_one_process():
    # before: the stages kept the trainable parameters of the moment rt.prepare ran, so a
    # block unfrozen later never got a gradient (silently)
    model, opt = _gpt()
    for step, (x, y) in enumerate(DataLoader(_data(), batch_size=BATCH)):
        _freeze_schedule(model, step)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    want = model.state_dict()
    for rank, got in enumerate(run_distributed(_refreezing, 2, args=("", None), init=False,
                                               timeout=300)):  # fmt: skip
        for schedule, state in got.items():
            assert _worst(state, {k: want[k] for k in state}) <= PARAM_TOL, (rank, schedule)


def _bf16_mixed_loop(schedule: str, v: int | None) -> list[float]:
    rt = rw.init(mesh={"pipeline": 2}, precision="bf16-mixed", timeout=200)
    return _train(rt, *_gpt(), DataLoader(_data(), batch_size=BATCH), schedule, v)[1]


@pytest.mark.parametrize("schedule, v", [("1f1b", None), ("interleaved_1f1b", 2)])
def test_bf16_mixed_under_a_pipeline_mesh_runs_autocast_on_every_stage(schedule, v):
    # The first step's loss is computed before any update: it equals one process's under
    # bf16 autocast bit for bit only if every stage ran in bf16 (the blocks on one rank, the
    # head and the loss on the other). After it, the micro-batches' bf16 gradients round
    # otherwise than the whole batch's: the losses stay close, not equal.
    ranks = run_distributed(_bf16_mixed_loop, 2, args=(schedule, v), init=False, timeout=300)
    want, fp32 = _oracle(autocast=torch.bfloat16)[2], _oracle()[2]
    assert ranks[0] == ranks[1]
    assert ranks[0][0] == want[0] and want[0] != fp32[0]
    assert max(abs(a - b) for a, b in zip(ranks[0], want, strict=True)) <= 1e-3


def _fp16_overflow_on_stage_0(overflow_step: int) -> dict:
    rt = rw.init(mesh={"pipeline": 2}, precision="fp16-mixed", timeout=200)
    model, opt = _gpt()
    loader = DataLoader(_data(), batch_size=BATCH)
    model, opt, loader = rt.prepare(model, opt, loader, pipeline_schedule="1f1b", microbatches=4)
    params = [p for p in model.parameters() if p.requires_grad]
    moved, scales = [], []
    for step, (x, y) in enumerate(loader):
        _, loss = model(x, y)
        rt.backward(loss)
        if step == overflow_step and rt.rank == 0:  # one stage's gradient overflows, alone
            params[0].grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        moved.append(any(not torch.equal(a, p) for a, p in zip(before, params, strict=True)))
        scales.append(opt.scaler.get_scale())
    return {"moved": moved, "scales": scales}


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage():
    # Each stage holds other parameters: were the scaler's inf check its own, the stage
    # without the overflow would step and the other skip, and the model's halves would
    # drift apart silently. Both skip the same step and halve the same scale.
    ranks = run_distributed(_fp16_overflow_on_stage_0, 2, args=(1,), init=False, timeout=300)
    for r in ranks:
        assert r["moved"] == [True, False, True], r
        assert r["scales"][1] == r["scales"][0] / 2, r["scales"]
    assert ranks[0]["scales"] == ranks[1]["scales"]
