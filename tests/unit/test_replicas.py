"""In-memory replicas without a process group: the buffer format (read back by safetensors, the
format's own library, as the independent oracle), its refusals of malformed input, the buddy
map, the choice of step, the global-batch rule, the host folder, and one process restoring a
replica into a fresh model and training on exactly as the uninterrupted run."""

from __future__ import annotations

import importlib
import io
import json
import struct

import pytest
import safetensors.torch as st
import torch
from torch import nn

from rankwise.errors import ConfigError


class _Lazy:
    """A name of the package under test, imported at its first use inside a test, not at
    collection: the fast tier's census credits a module to the tests that import it while
    they run (tests/fast_tier.py)."""

    def __init__(self, module: str, name: str | None = None) -> None:
        self._module, self._name = module, name

    def _get(self):
        found = importlib.import_module(self._module)
        return getattr(found, self._name) if self._name else found

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # pytest's collection probes every module name for markers
            raise AttributeError(attr)
        return getattr(self._get(), attr)

    def __call__(self, *args, **kwargs):
        return self._get()(*args, **kwargs)


Replicas = _Lazy("rankwise.replicas", "Replicas")
describe = _Lazy("rankwise.replicas", "describe")
Held = _Lazy("rankwise.replicas.plan", "Held")
blob, plan, store = (_Lazy(f"rankwise.replicas.{m}") for m in ("blob", "plan", "store"))

STATE = {
    "w": torch.randn(3, 4),
    "half": torch.randn(5).to(torch.bfloat16),
    "view": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    "empty": torch.empty(0, 7),
    "flags": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
    "opt": {"state": {0: {"step": torch.tensor(3.0), "momentum": torch.ones(2)}},
            "param_groups": [{"lr": 0.1, "params": [0], "nesterov": False, "x": None}]},
    "rng": ("v", (1, 2, 3), float("inf")),
    "text": "loader",
}  # fmt: skip


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_round_trip_keeps_structure_dtypes_and_values():
    buf = blob.encode(STATE, {"step": 7, "rank": 1})
    state, info = blob.decode(buf)
    _same(STATE, state)
    assert info == {"step": 7, "rank": 1}


def test_the_buffer_is_a_safetensors_file():
    buf = blob.encode(STATE, {})
    tensors = st.load(buf.numpy().tobytes())
    flat = [STATE["w"], STATE["half"], STATE["view"], STATE["empty"], STATE["flags"]]
    for i, t in enumerate(flat):
        assert torch.equal(tensors[f"t{i}"], t)


def test_the_snapshot_is_a_copy():
    w = torch.zeros(4)
    buf = blob.encode({"w": w}, {})
    w += 1  # training goes on
    assert torch.equal(blob.decode(buf)[0]["w"], torch.zeros(4))


def _header(buf: torch.Tensor) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", buf[:8].numpy().tobytes())
    return n, json.loads(buf[8 : 8 + n].numpy().tobytes())


def _with_header(buf: torch.Tensor, header: dict) -> torch.Tensor:
    n, _ = _header(buf)
    text = json.dumps(header).encode()
    return torch.frombuffer(bytearray(struct.pack("<Q", len(text)) + text +
                                      buf[8 + n :].numpy().tobytes()), dtype=torch.uint8)  # fmt: skip


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b, h: b[:5],  # truncated before the header length
        lambda b, h: torch.cat([torch.tensor([255] * 8, dtype=torch.uint8), b[8:]]),  # a lie
        lambda b, h: b[: b.numel() - 3],  # the last tensor's bytes cut short
        lambda b, h: _with_header(b, {**h, "t0": {**h["t0"], "data_offsets": [0, 10**9]}}),
        lambda b, h: _with_header(b, {**h, "t0": {**h["t0"], "dtype": "OBJECT"}}),
        lambda b, h: _with_header(b, {**h, "t0": {**h["t0"], "shape": [-1, 12]}}),
        lambda b, h: _with_header(b, {**h, "__metadata__": {"skeleton": '{"$x": 1}', "info": "{}"}}),
        lambda b, h: _with_header(b, {**h, "__metadata__": {"skeleton": "[", "info": "{}"}}),
    ],
)
def test_malformed_buffers_are_refused_by_name(mangle):
    buf = blob.encode({"w": torch.randn(3, 4)}, {})
    with pytest.raises(ConfigError, match="replica is malformed"):
        blob.decode(mangle(buf, _header(buf)[1]))


def test_a_pickle_is_never_read():
    raw = io.BytesIO()
    torch.save({"w": torch.ones(2)}, raw)
    with pytest.raises(ConfigError, match="malformed"):
        blob.decode(raw.getvalue())


def test_objects_are_refused_with_their_type():
    with pytest.raises(ConfigError, match="holds a Linear"):
        blob.encode({"m": nn.Linear(2, 2)}, {})


@pytest.mark.parametrize(("world", "local"), [(1, 1), (2, 1), (3, 1), (4, 2), (6, 2), (2, 2), (8, 4)])
def test_buddy_is_a_permutation_on_another_host(world, local):
    buddies = [plan.buddy_of(r, world, local) for r in range(world)]
    assert sorted(buddies) == list(range(world))
    for r, b in enumerate(buddies):
        assert plan.buddy_source(b, world, local) == r
        if world > local:  # more than one node: the copy lives on another node
            assert b // local != r // local
        elif world > 1:
            assert b != r


def test_choose_the_newest_step_every_old_rank_survives_for():
    # 3 ranks; host 2 lost: host 0 holds r0 and r2 (its buddy), host 1 holds r1 and r0
    held = [[Held(0, 4, 3), Held(2, 4, 3), Held(0, 6, 3), Held(2, 6, 3)],
            [Held(1, 4, 3), Held(0, 4, 3), Held(0, 6, 3)]]  # fmt: skip
    assert plan.choose(held) == (4, 3)  # step 6 lacks rank 1 (its copy was in flight)
    held[1].append(Held(1, 6, 3))
    assert plan.choose(held) == (6, 3)
    assert plan.holders(held, 6, 3) == {0: 0, 2: 0, 1: 1}
    assert plan.choose([[Held(0, 4, 2)], []]) is None  # rank 1 of that world is nowhere
    assert plan.choose([[], []]) is None


@pytest.mark.parametrize(("new", "old", "expected"), [(0, 3, (0, True)), (1, 2, (1, True)),
                                                      (2, 2, (0, False)), (5, 2, (1, False))])  # fmt: skip
def test_source_of_each_new_rank(new, old, expected):
    assert plan.source(new, old) == expected


@pytest.mark.parametrize(("world", "micro", "acc"), [(3, 2, 2), (2, 2, 3), (1, 2, 6), (6, 2, 1),
                                                     (4, 3, 1)])  # fmt: skip
def test_accumulation_keeps_the_global_batch(world, micro, acc):
    assert plan.accumulation_for(12, world, micro) == acc
    assert world * micro * acc == 12


@pytest.mark.parametrize(("world", "micro"), [(5, 2), (4, 2), (8, 2), (7, 1)])
def test_a_global_batch_that_cannot_be_kept_is_refused_with_the_numbers(world, micro):
    with pytest.raises(ConfigError) as err:
        plan.accumulation_for(12, world, micro)
    text = str(err.value)
    assert "12" in text and f"{world} x {micro}" in text and "--nnodes" in text


def test_store_writes_whole_files_lists_and_prunes(tmp_path):
    buf = blob.encode({"w": torch.ones(3)}, {})
    for step in (2, 4, 6):
        store.write(tmp_path / "h", Held(0, step, 2), buf)
    (tmp_path / "h" / ".r1-s8-w2.rwr.123.tmp").write_bytes(b"partial")  # a write cut short
    assert [h.step for h in store.listing(tmp_path / "h")] == [2, 4, 6]
    store.prune(tmp_path / "h", 4)
    assert store.listing(tmp_path / "h") == [Held(0, 4, 2), Held(0, 6, 2)]
    assert torch.equal(store.read(tmp_path / "h", Held(0, 6, 2)), buf)
    assert store.listing(tmp_path / "missing") == []


def test_default_folder_is_per_run_and_host(monkeypatch, tmp_path):
    monkeypatch.setenv("RANKWISE_REPLICA_DIR", str(tmp_path))
    monkeypatch.setenv("RANKWISE_REPLICA_HOST", "node/b")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job 7")
    assert store.default_folder() == tmp_path / "job_7" / "node_b"


def _train(model, opt, steps):
    """``steps`` steps drawing data and dropout from the global RNG."""
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _fresh():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_one_process_restores_and_trains_on_as_the_uninterrupted_run(tmp_path):
    model, opt = _fresh()
    _train(model, opt, 3)
    reps = Replicas(model=model, optimizer=opt, folder=tmp_path, every=3)
    assert reps.step(3) and not reps.step(4)
    reps.close()
    _train(model, opt, 2)  # the uninterrupted run goes on
    fresh, opt2 = _fresh()
    torch.manual_seed(123)  # another RNG state: the restore must put the replica's back
    got = Replicas(model=fresh, optimizer=opt2, folder=tmp_path).restore()
    assert got["step"] == 3 and got["resized"] is None and got["accumulation"] == 1
    _train(fresh, opt2, 2)  # the same data and dropout masks only if the RNG came back
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_nothing_to_restore_is_none(tmp_path):
    model, opt = _fresh()
    assert Replicas(model=model, optimizer=opt, folder=tmp_path / "empty").restore() is None


def test_bad_arguments_name_the_value(tmp_path):
    model, opt = _fresh()
    with pytest.raises(ConfigError, match="every=0"):
        Replicas(model=model, optimizer=opt, folder=tmp_path, every=0)
    with pytest.raises(ConfigError, match="loader"):
        Replicas(model=model, optimizer=opt, folder=tmp_path, global_batch=12)


def test_the_resize_line_names_world_step_accumulation_and_time():
    from rankwise.replicas import ResizeEvent

    line = describe(ResizeEvent(step=40, old_world=3, new_world=2, old_accumulation=2,
                                accumulation=3, lost_hosts=("node-c",), joined_hosts=(),
                                seconds_lost=6.25), 12)  # fmt: skip
    for fact in ("3 to 2", "lost host node-c", "step 40", "2 -> 3", "global batch 12", "6.2 s"):
        assert fact in line


@pytest.mark.parametrize(("cost", "step", "every"), [(0.1, 1.0, 4), (0.03, 1.0, 1), (0.001, 1.0, 1),
                                                     (0.3, 0.1, 100), (100.0, 0.001, 1000),
                                                     (0.0, 1.0, 1)])  # fmt: skip
def test_the_auto_interval_keeps_copies_within_the_budget(cost, step, every):
    from rankwise.replicas.interval import BUDGET, interval

    assert interval(cost, step) == every
    if every < 1000:  # the smallest such K: one less would exceed the budget
        assert cost <= BUDGET * every * step + 1e-12
        assert every == 1 or cost > BUDGET * (every - 1) * step


def test_auto_calibrates_on_the_second_step_then_replicates_on_its_multiples(tmp_path):
    model, opt = _fresh()
    reps = Replicas(model=model, optimizer=opt, folder=tmp_path)  # every="auto", the default
    assert reps.every is None
    assert reps.step(1)  # the first call copies and times the copy
    _train(model, opt, 1)
    reps.step(2)
    k = reps.every
    assert isinstance(k, int) and 1 <= k <= 1000
    assert [s for s in range(3, 3 + 2 * k) if reps.step(s)] == [s for s in range(3, 3 + 2 * k)
                                                               if s % k == 0]  # fmt: skip
    reps.close()


def test_the_last_call_setting_reaches_the_c10d_rendezvous(monkeypatch):
    from rankwise.launch.options import LaunchOptions, choose_rendezvous

    opts = LaunchOptions(script="t.py", nproc_per_node=1, nnodes=3, min_nodes=1,
                         rdzv_backend="c10d", rdzv_endpoint="node0:29400")  # fmt: skip
    assert "last_call_timeout" not in choose_rendezvous(opts, new_id="A").config  # torch's 30 s
    monkeypatch.setenv("RANKWISE_RDZV_LAST_CALL_S", "2")
    assert choose_rendezvous(opts, new_id="A").config["last_call_timeout"] == 2
    monkeypatch.setenv("RANKWISE_RDZV_LAST_CALL_S", "soon")
    with pytest.raises(ConfigError, match="RANKWISE_RDZV_LAST_CALL_S='soon'"):
        choose_rendezvous(opts, new_id="A")


@pytest.mark.parametrize("strategy", ["single", "dp", "zero3"])
def test_the_readme_loop_restores_exactly_under_one_process_strategies(tmp_path, strategy):
    """rt.prepare'd model, AdamW in two parameter groups with a schedule, rt.replicas, then a
    restore into a fresh prepare: it trains on as the uninterrupted run (ddp and zero1-3 across
    processes: tests/dist/test_replicas_dist.py)."""
    import rankwise as rw

    def build():
        torch.manual_seed(0)
        # dp's CPU replicas are threads drawing from torch's one CPU generator in whatever order
        # they run (docs/dp.md): dropout there would differ from run to run, replicas or not
        drop = nn.Identity() if strategy == "dp" else nn.Dropout(0.3)
        net = nn.Sequential(nn.Linear(6, 8), drop, nn.Linear(8, 2))
        opt = torch.optim.AdamW([{"params": net[0].parameters(), "weight_decay": 0.1},
                                 {"params": net[2].parameters(), "weight_decay": 0.0}], lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return (*rt.prepare(net, opt), sched)

    def train(model, opt, sched, steps):
        for _ in range(steps):
            _train(model, opt, 1)
            sched.step()

    rt = rw.init(strategy=strategy, **({"devices": ["cpu", "cpu"]} if strategy == "dp" else {}))
    model, opt, sched = build()
    train(model, opt, sched, 3)
    reps = rt.replicas(model, opt, every=3, folder=tmp_path)
    assert reps.sharded == (strategy == "zero3")  # ZeRO: the shards' path, resharded on load
    assert reps.step(3)
    reps.close()
    train(model, opt, sched, 2)
    fresh, opt2, sched2 = build()
    torch.manual_seed(123)
    assert rt.replicas(fresh, opt2, folder=tmp_path).restore()["step"] == 3
    assert [g["lr"] for g in opt2.param_groups] == [0.005, 0.005]  # the schedule's, restored
    sched2.last_epoch = 3  # the user's own scheduler object steps on from the restored step
    train(fresh, opt2, sched2, 2)
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("wrote", "reads"), [("zero3", "single"), ("single", "zero1")])
def test_replicas_of_another_layout_are_refused_naming_both(tmp_path, wrote, reads):
    """ZeRO's replicas hold shards, the others the whole state: resuming one with the other
    strategy is refused with the strategy to use, not read as garbage."""
    import rankwise as rw

    def prepared(strategy):
        rt = rw.init(strategy=strategy)
        torch.manual_seed(0)
        net = nn.Linear(6, 2)
        return rt, *rt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

    rt, model, opt = prepared(wrote)
    _train(model, opt, 1)
    reps = rt.replicas(model, opt, every=1, folder=tmp_path)
    reps.step(1)
    reps.close()
    rw.shutdown()
    rt, model, opt = prepared(reads)
    with pytest.raises(ConfigError) as info:
        rt.replicas(model, opt, folder=tmp_path).restore()
    text = str(info.value)
    assert "step 1" in text and "ZeRO" in text, text
    assert ("zero1-3" if wrote == "zero3" else "ddp") in text and "rt.load" in text, text
