"""The schedule executor in one process (``rw.split(..., schedule=...).train_step``: one thread
per position, queues between them): every schedule gives the unsplit model's loss and
gradients; the split backward (zero bubble) computes each weight's gradient once; the plan that
cuts a ModuleList model into stages, and the pieces around it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.errors import ConfigError
from rankwise.models import GPT
from rankwise.models.gpt import GPTConfig, sequential_gpt
from rankwise.pipeline import blocks, outputs
from rankwise.pipeline.execution.weight_pass import WeightPass

TOL = 1e-6
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zero_bubble", 2)]


def _gpt() -> nn.Sequential:
    torch.manual_seed(0)
    return sequential_gpt(GPTConfig(vocab_size=32, block_size=8, n_layer=6, n_head=2, n_embd=16))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _batch(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 32, (n, 8), generator=g), torch.randint(0, 32, (n, 8), generator=g)


@pytest.mark.parametrize(("schedule", "v"), CASES)
@pytest.mark.parametrize(("positions", "chunks"), [(2, 4), (3, 5), (4, 4)])
def test_every_schedule_gives_the_unsplit_gradients(schedule, v, positions, chunks):
    if positions * v > 8:
        pytest.skip("more stages than layers")
    ref = _gpt()
    pipe = rw.split(copy.deepcopy(ref), ["cpu"] * positions, chunks=chunks, schedule=schedule,
                    stages_per_rank=v)  # fmt: skip
    x, y = _batch()  # 10 samples in `chunks` micro-batches: uneven sizes
    want = _loss(ref(x), y)
    want.backward()
    got = pipe.train_step(x, y, _loss)
    assert abs(got.item() - want.item()) <= TOL
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= TOL, name
    ran = [e.action for r in pipe.last_step for e in r.events]
    kinds = {"I", "W"} if schedule == "zero_bubble" else {"B"}
    assert {a.kind for a in ran} == kinds | {"F"} and len(ran) == len(set(ran))


def _freeze_some(model: nn.Sequential) -> nn.Sequential:
    """What fine-tuning does: the embeddings and the first block frozen whole, one layer with
    only its weight frozen (its bias still trains)."""
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    model[3].attn.proj.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize(("schedule", "v"), CASES)
def test_every_schedule_with_frozen_layers_gives_the_unsplit_gradients(schedule, v):
    # a frozen layer is not cut for the W pass (before: zero_bubble asked autograd for the
    # gradients of no weights and raised)
    ref = _freeze_some(_gpt())
    pipe = rw.split(copy.deepcopy(ref), ["cpu", "cpu"], chunks=4, schedule=schedule,
                    stages_per_rank=v)  # fmt: skip
    x, y = _batch()
    _loss(ref(x), y).backward()
    pipe.train_step(x, y, _loss)
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) == (not q.requires_grad), name
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max() <= TOL, name


def test_a_failing_stage_stops_every_thread_and_raises():
    pipe = rw.split(_gpt(), ["cpu", "cpu"], chunks=2)
    x, y = _batch()
    with pytest.raises(IndexError, match="out of bounds"):  # the last stage fails: no hang
        pipe.train_step(x, y + 1000, _loss)


def test_split_backward_computes_each_weight_gradient_once_and_exactly():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    twin = copy.deepcopy(model)
    x, y = _batch(4)
    twin(x, y)[1].backward()
    passes = WeightPass(model.modules())
    anchor = passes.begin((0, 0))
    _, loss = model(x, y)
    passes.end()
    params = [p for p in model.parameters()]
    first = torch.autograd.grad(loss, [anchor, *params], allow_unused=True)[1:]
    # The I pass leaves the weights of the cut layers alone (only what is used outside them).
    cut = {id(p) for m in model.modules() if m is not model for p in m.parameters(recurse=False)}
    assert all(g is None for p, g in zip(params, first, strict=True) if id(p) in cut)
    grads = {}
    for p, g in passes.run((0, 0)):
        grads[id(p)] = grads.get(id(p), 0) + g
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (grads[id(p)] - q.grad).abs().max() <= TOL, name  # the tied head: both parts


def test_plan_cuts_gpt_blocks_with_embeddings_first_and_head_last():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=8, n_head=2, n_embd=16))
    plan = blocks.plan(model, 4)
    assert plan.container == "blocks" and plan.blocks == tuple(str(i) for i in range(8))
    assert plan.pre == ("wte", "wpe", "drop") and plan.post == ("ln_f", "lm_head")
    sizes = [plan.bounds[s + 1] - plan.bounds[s] for s in range(4)]
    assert sum(sizes) == 8 and min(sizes) >= 1
    assert sizes[0] <= sizes[1] and sizes[-1] <= sizes[1]  # the ends also hold the embedding
    runner = blocks.localize(model, plan, [3], torch.device("cpu"))
    assert isinstance(model.wte, blocks.Absent) and isinstance(model.lm_head, nn.Linear)
    held = set(model.state_dict())
    assert "lm_head.weight" in held and "wte.weight" not in held
    assert {k.split(".")[1] for k in held if k.startswith("blocks.")} == set(plan.blocks_of(3))
    assert runner is model.blocks


def test_plan_refuses_models_it_cannot_cut_naming_the_fix():
    flat = nn.Module()
    flat.fc = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="ModuleList"):
        blocks.plan(flat, 2)
    torch.manual_seed(0)
    small = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    with pytest.raises(ConfigError, match=r"2 blocks.*fewer than the 4"):
        blocks.plan(small, 4)

    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(2))
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    with pytest.raises(ConfigError, match=r"\['scale'\]"):
        blocks.plan(Raw(), 2)


def test_inputs_are_cut_along_the_batch_and_outputs_put_back():
    x, y = torch.randn(7, 3), torch.arange(7)
    cut = outputs.split_inputs((x, y, 0.5), {"mask": torch.ones(7, 2)}, 3, with_target=False)
    assert cut.sizes == [3, 2, 2] and cut.args[1][2] == 0.5
    assert torch.equal(torch.cat([a[0] for a in cut.args]), x)
    assert torch.equal(torch.cat([k["mask"] for k in cut.kwargs]), torch.ones(7, 2))
    with_target = outputs.split_inputs((x, y), {}, 2, with_target=True)
    assert [t.tolist() for t in with_target.targets] == [[0, 1, 2, 3], [4, 5, 6]]
    loss = torch.tensor(2.0, requires_grad=True)
    assert outputs.structure_of((torch.randn(2), loss), train=True) == outputs.Outputs(1, 2, 1)
    with pytest.raises(ConfigError, match="loss_fn="):
        outputs.structure_of(torch.randn(3, 2), train=True)
    assert outputs.rebuild(outputs.Outputs(1, 2, 1), loss) == (None, loss)
    merged = outputs.merge([(torch.ones(2, 1), torch.tensor(1.0)),
                            (torch.zeros(1, 1), torch.tensor(4.0))], [2 / 3, 1 / 3])  # fmt: skip
    assert merged[0].shape == (3, 1) and merged[1].item() == pytest.approx(2.0)


class _Scaled(nn.Module):
    """A layer with a bare parameter used in its own forward: not cut by the split backward."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((16,), 1.5))
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * self.gain)


def test_zero_bubble_with_weights_used_outside_cut_layers():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 16), _Scaled(), _Scaled(), nn.Linear(16, 3))
    pipe = rw.split(copy.deepcopy(ref), ["cpu", "cpu"], chunks=3, schedule="zero_bubble")
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    F.cross_entropy(ref(x), y).backward()
    pipe.train_step(x, y, F.cross_entropy)
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= TOL, name


def test_blocks_called_with_extra_arguments_or_by_index_are_refused():
    runner = blocks.StageBlocks({"0": nn.Linear(2, 2)}, {0: ["0"]})
    runner.mode = "post"
    with pytest.raises(ConfigError, match="2 argument"):
        runner(torch.ones(2), torch.ones(2))
    with pytest.raises(ConfigError, match=r"(?s)blocks\[3\].*iterate"):
        runner[3]
    assert list(runner) == [runner]  # `for block in self.blocks` calls it once


def test_zero3_and_pipeline_options_without_a_pipeline_are_refused():
    from types import SimpleNamespace

    from rankwise.job.mesh import DeviceMesh
    from rankwise.session.pipeline import PipelineOptions, pipeline_stages
    from rankwise.strategies import get

    rt = SimpleNamespace(mesh=DeviceMesh({"pipeline": 2}), strategy="zero3",
                         strategy_spec=get("zero3"), rank=0)  # fmt: skip
    with pytest.raises(ConfigError, match="'zero2'"):
        pipeline_stages(rt, nn.Linear(2, 2), None, PipelineOptions())
    flat = SimpleNamespace(mesh=None, rank=0)
    with pytest.raises(ConfigError, match="pipeline_schedule=, microbatches="):
        pipeline_stages(flat, nn.Linear(2, 2), None,
                        PipelineOptions(schedule="1f1b", microbatches=4))  # fmt: skip


def test_the_channel_tables_are_each_schedules_own_and_built_once_per_schedule():
    """The executor reuses its read-only tables (channels and acknowledgements) step after
    step; a schedule with the same name and sizes but another order never gets them."""
    import dataclasses

    from rankwise.pipeline import schedules as S
    from rankwise.pipeline.execution.tables import tables as _tables

    for name, v in CASES:
        schedule = S.make(name, 3, 6, v)
        # same name and sizes, another order: 1F1B's actions under GPipe's name, and so on
        other = dataclasses.replace(S.make("gpipe" if name != "gpipe" else "1f1b", 3, 6, v),
                                    name=name)  # fmt: skip
        for s in (schedule, other):
            for pos in range(3):
                channels, acks, _ = _tables(s, pos)
                assert channels == {src: tuple(s.sends(src, pos)) for src in range(3) if src != pos}
                assert acks == {src: tuple(s.acks(src, pos)) for src in channels}
                assert _tables(s, pos)[0] is channels  # built once


@pytest.mark.parametrize("name, v", [("interleaved_1f1b", 2), ("zero_bubble", 2), ("1f1b", 1)])
def test_each_streams_next_message_is_found_from_any_point_of_the_channel(name, v):
    """What the executor posts ahead: from each point of a channel, the next message of each
    of its streams (kind, sending stage, micro-batch parity), found by brute force here."""
    from rankwise.pipeline import schedules as S
    from rankwise.pipeline.execution.executor import firsts

    def key(m):
        return m.kind, m.src_stage, m.micro_batch % 2

    s = S.make(name, 2, 8, v)
    channels = {src: tuple(s.sends(src, 1 - src)) for src in (0, 1)}
    found = firsts(channels)
    for src, channel in channels.items():
        streams = {key(m) for m in channel}
        assert len(streams) == 2 * (3 if v == 2 else 1)  # with two stages per rank: mixed
        for i in range(len(channel)):
            want = sorted(min(j for j in range(i, len(channel)) if key(channel[j]) == k)
                          for k in streams if any(key(m) == k for m in channel[i:]))  # fmt: skip
            assert list(found[src][i]) == want
