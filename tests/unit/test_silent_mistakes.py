"""Mistakes that used to train in silence now warn or fail with the fix (session/guards.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.check import check_file


def _data(n: int = 24) -> TensorDataset:
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 3, (n,)))


def _setup(**init):
    rt = rw.init(**init)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return rt, model, opt


# -- rt.prepare twice: one refusal under every strategy -----------------------------------------


@pytest.mark.parametrize(
    "init", [{"strategy": "single"}, {"strategy": "ddp"}, {"precision": "fp16-mixed"}],
    ids=["single", "ddp", "fp16-mixed"],
)
def test_prepare_twice_is_refused_the_same_way_under_every_strategy(init):
    # Before: accepted under single; "already wrapped, pass model.module" under ddp (wrong
    # advice: the bare model was already prepared); "a second optimizer" under fp16-mixed.
    rt, model, opt = _setup(**init)
    model, opt, loader = rt.prepare(model, opt, DataLoader(_data(), batch_size=4))
    with pytest.raises(rw.ConfigError) as refused:
        rt.prepare(model, opt, loader)
    text = str(refused.value)
    assert "rt.prepare() got a model" in text and "already prepared" in text
    assert "Fix: call rt.prepare once" in text and "model, opt, loader = rt.prepare(" in text


def test_the_bare_model_and_the_given_loader_count_as_prepared_too():
    rt, model, opt = _setup(strategy="ddp")
    given = DataLoader(_data(), batch_size=4)
    rt.prepare(model, opt, given)  # results dropped
    with pytest.raises(rw.ConfigError, match=r"got a model .*already prepared"):
        rt.prepare(model, opt, given)
    with pytest.raises(rw.ConfigError, match=r"got a loader .*already prepared"):
        rt.prepare(nn.Linear(4, 3), None, given)


def test_a_failed_prepare_can_be_retried_with_the_same_model():
    rt, model, opt = _setup()
    with pytest.raises(rw.ConfigError):
        rt.prepare(model, opt, DataLoader(_data(10), batch_size=16, drop_last=True))
    rt.prepare(model, opt, DataLoader(_data(10), batch_size=5, drop_last=True))


# -- a loader with no batch ---------------------------------------------------------------------


def test_drop_last_with_a_batch_larger_than_the_data_fails_with_the_numbers():
    # Before: prepare accepted it and every epoch ran 0 steps.
    rt, model, opt = _setup()
    with pytest.raises(rw.ConfigError) as refused:
        rt.prepare(model, opt, DataLoader(_data(10), batch_size=16, drop_last=True))
    assert str(refused.value) == (
        "DataLoader(batch_size=16, drop_last=True) gives 0 batches per epoch: this process's "
        "share of the data set is 10 sample(s), fewer than its batch of 16, and drop_last=True "
        "drops the short batch; the training loop would never run\n"
        "Fix: use a batch of at most 10 sample(s) per process, or drop_last=False."
    )


def test_an_evaluation_loader_may_be_short_and_a_kept_one_is_not_refused():
    rt = rw.init()
    evaluation = rt.prepare_loader(DataLoader(_data(10), batch_size=16), evaluation=True)
    assert len(evaluation) == 1


# -- prepare's loader not used --------------------------------------------------------------------


def test_iterating_the_original_loader_after_prepare_warns_and_the_returned_one_does_not():
    # Before: silent; under the launcher every rank then read the whole data set.
    rt, model, opt = _setup()
    given = DataLoader(_data(), batch_size=4)
    model, opt, loader = rt.prepare(model, opt, given)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(loader)) == 6
    with pytest.warns(UserWarning, match="given to rt.prepare.*whole data set") as caught:
        batches = list(given)
    assert len(batches) == 6  # the original still works: only a warning
    assert "Fix: call rt.prepare once" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the user's loop


# -- a scheduler left out of the checkpoint ---------------------------------------------------------


def test_saving_without_the_scheduler_that_drives_the_optimizer_warns(tmp_path):
    # Before: rt.save wrote no scheduler state; a resumed run restarted the schedule.
    rt, model, opt = _setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, opt = rt.prepare(model, opt)
    with pytest.warns(UserWarning, match="scheduler drives this optimizer") as caught:
        rt.save(tmp_path / "a.pt", model=model, optimizer=opt)
    assert "scheduler=sched" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.save(tmp_path / "b.pt", model=model, optimizer=opt, scheduler=sched)
    assert torch.load(tmp_path / "b.pt", weights_only=False)["scheduler"] == sched.state_dict()


def test_a_scheduler_passed_to_prepare_is_saved_without_a_warning(tmp_path):
    rt, model, opt = _setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, opt, sched = rt.prepare(model, opt, scheduler=sched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.save(tmp_path / "c.pt", model=model, optimizer=opt)


# -- torch's clip on scaled gradients ---------------------------------------------------------------


def _fp16_step(clip) -> list:
    rw.shutdown()
    rt, model, opt = _setup(precision="fp16-mixed")
    model, opt = rt.prepare(model, opt)
    x, y = _data(8).tensors
    rt.backward(F.cross_entropy(model(x), y))
    clip(rt, model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return [str(w.message) for w in caught if "fp16-mixed" in str(w.message)]


def test_torch_clip_after_rt_backward_under_fp16_warns_with_the_fix():
    # Before: torch.nn.utils.clip_grad_norm_ clipped the scaled gradient (a norm ~65536 times
    # too large, clipped to 1.0), silently.
    said = _fp16_step(lambda rt, m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    assert len(said) == 1 and "rt.clip_grad_norm_(model, max_norm)" in said[0]
    assert "65536" in said[0]


@pytest.mark.parametrize(
    "clip",
    [
        lambda rt, m, o: rt.clip_grad_norm_(m, 1.0),
        lambda rt, m, o: (o.unscale_(), torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)),
        lambda rt, m, o: None,
    ],
    ids=["rt.clip_grad_norm_", "unscale_-then-torch-clip", "no-clip"],
)
def test_clipping_the_unscaled_gradients_does_not_warn(clip):
    assert _fp16_step(clip) == []


# -- rt.prepare(loader): the suggested call works ---------------------------------------------------


def test_prepare_given_a_loader_after_the_model_suggests_prepare_loader_which_works():
    # Before: "pass the model first: rt.prepare(model, optimizer, loader)", which then failed
    # with "got a model that is already prepared".
    rt, model, _ = _setup(strategy="ddp")
    model = rt.prepare(model)
    given = DataLoader(_data(), batch_size=4)
    with pytest.raises(rw.ConfigError) as refused:
        rt.prepare(given)
    text = str(refused.value)
    assert "rt.prepare() got a DataLoader as its model" in text
    assert "Fix: the model is prepared already" in text and "rt.prepare_loader(loader)" in text
    loader = rt.prepare_loader(given)  # the suggested call
    assert len(list(loader)) == 6 and loader in rt.loop.loaders  # prepared for rt.accumulate


def test_prepare_given_a_loader_first_suggests_both_calls():
    rt, model, opt = _setup()
    with pytest.raises(rw.ConfigError) as refused:
        rt.prepare(DataLoader(_data(), batch_size=4))
    text = str(refused.value)
    assert "Fix: pass the model first: model, opt, loader = rt.prepare(model, opt, loader)" in text
    assert "rt.prepare_loader(loader)" in text
    assert len(rt.prepare(model, opt, DataLoader(_data(), batch_size=4))) == 3  # works


def test_preparing_a_prepared_model_again_with_a_new_loader_points_at_prepare_loader():
    rt, model, opt = _setup(strategy="ddp")
    model, opt = rt.prepare(model, opt)
    with pytest.raises(rw.ConfigError) as refused:
        rt.prepare(model, opt, DataLoader(_data(), batch_size=4))
    text = str(refused.value)
    assert "already prepared" in text and "rt.prepare_loader(loader)" in text


# -- a second run into a checkpoint folder ----------------------------------------------------------


def _run(folder, steps, *, load=False, step_numbers=True) -> list[str]:
    """One run: rw.init, prepare, (rt.load), then save ``steps``; returns what it warned."""
    rw.shutdown()
    rt, model, opt = _setup()
    model, opt = rt.prepare(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if load:
            rt.load(folder, model=model, optimizer=opt)
        for step in steps:
            rt.save(folder, model=model, optimizer=opt, step=step if step_numbers else None)
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "this run" in str(w.message)]


def test_a_second_run_into_a_checkpoint_folder_without_loading_it_warns(tmp_path):
    # Before: the second run's saves continued the first run's numbering (ckpt-3, ckpt-4 after
    # ckpt-0..2) or overwrote its steps, and nothing was said.
    folder = tmp_path / "ckpt"
    assert _run(folder, [0, 1, 2]) == []  # a first run: nothing to say, even saving 3 times
    (said,) = _run(folder, [None, None], step_numbers=False)  # once per folder and run
    assert f"'{folder}' already holds a checkpoint at step 2" in said
    assert "continues its numbering as step 3" in said
    assert "Fix: resume with rt.load(" in said and "or give this run a new folder" in said
    assert said.startswith(f"{__file__}:")  # at the user's rt.save line
    (said,) = _run(folder, [4])  # the same step as the folder's last: overwritten
    assert "at step 4" in said and "this save of step 4 overwrites it" in said


def test_resuming_or_a_new_folder_or_a_later_step_does_not_warn(tmp_path):
    folder = tmp_path / "ckpt"
    _run(folder, [0, 1])
    assert _run(folder, [2, 3], load=True) == []  # rt.load(folder) first: a resume
    assert _run(tmp_path / "fresh", [0]) == []
    assert _run(folder, [10]) == []  # a later step: the numbering does not collide
    assert sorted(p.name for p in folder.glob("ckpt-*.pt"))[-1] == "ckpt-00000010.pt"


# -- the ten classic mistakes (docs/pitfalls.md#ten-mistakes): one test per row ----------------------
# Each row's `rankwise check` column: the bad script of tests/check_corpus/ gives exactly these
# rules. Each row's run-time column: the test named in TEN_RUNTIME (here, or in
# tests/dist/test_silent_mistakes_dist.py for the multi-process rows).

CORPUS = Path(__file__).resolve().parents[1] / "check_corpus" / "bad"
TEN_CHECK = {
    "1 wrap before moving to the device": [("pitfall_cpu_model_wrap.py", "RW001")],
    "2 init twice": [("pitfall_init_twice.py", "RW002")],
    "3 no DistributedSampler / shuffle with one": [
        ("ddp_no_sampler.py", "RW004"), ("pitfall_sampler_shuffle.py", "RW003")],
    "4 set_epoch forgotten": [("missing_set_epoch.py", "RW005")],
    "5 what batch_size means": [("pitfall_dp_batch_divided.py", "RW012")],
    "6 module. prefix": [("pitfall_wrapped_state_dict.py", "RW006")],
    "7 print / save on every rank": [
        ("pitfall_print_all_ranks.py", "RW007"), ("save_all_ranks.py", "RW008")],
    "8 loader not given to rt.prepare": [
        ("loader_not_prepared.py", "RW018"), ("loader_prepared_result_unused.py", "RW018")],
    "9 model built or stepped outside rt.prepare": [
        ("model_outside_prepare.py", "RW019"), ("train_before_prepare.py", "RW019")],
    "10 checkpoint folder reused": [],  # run time only: the folder's contents are not in the script
}  # fmt: skip


@pytest.mark.parametrize("row", TEN_CHECK)
def test_ten_mistakes_check_column(row):
    for name, rule in TEN_CHECK[row]:
        found = {f.rule for f in check_file(CORPUS / name).findings}
        assert rule in found, f"{row}: {name} gives {found}"


def test_ten_mistakes_1_prepare_moves_then_wraps_and_a_hand_wrap_of_a_cpu_model_is_refused():
    rt = rw.init(strategy="ddp")
    model = rt.prepare(nn.Linear(4, 3))
    assert isinstance(model, rw.DistributedDataParallel)
    assert {p.device for p in model.parameters()} == {rt.device}
    with pytest.raises(rw.ConfigError, match=r"parameters are on cpu but device_ids=\[0\]"):
        rw.DistributedDataParallel(nn.Linear(4, 3), device_ids=[0])


def test_ten_mistakes_2_init_again_returns_the_runtime_and_a_conflicting_one_is_refused():
    rt = rw.init(strategy="single")
    assert rw.init() is rt
    with pytest.raises(rw.RuntimeStateError, match="strategy=single; this call asks for strategy=dp"):
        rw.init(strategy="dp", devices=["cpu", "cpu"])


def test_ten_mistakes_3_prepare_puts_a_distributed_sampler_in_and_shuffle_with_one_is_refused():
    rt, model, opt = _setup(strategy="ddp")
    model, opt, loader = rt.prepare(model, opt, DataLoader(_data(), batch_size=4, shuffle=True))
    assert isinstance(loader.sampler, rw.DistributedSampler) and loader.sampler.shuffle
    with pytest.raises(rw.ConfigError, match="shuffle=True was given together with sampler="):
        rw.loader(_data(), batch_size=4, sampler=rw.DistributedSampler(_data()), shuffle=True)


def test_ten_mistakes_4_a_prepared_loader_moves_to_the_next_epoch_without_set_epoch():
    rt, model, opt = _setup()
    model, opt, loader = rt.prepare(model, opt, DataLoader(_data(), batch_size=24, shuffle=True))
    first, second = ([y.tolist() for _, y in loader] for _ in range(2))
    assert first != second and sorted(first[0]) == sorted(second[0])


def test_ten_mistakes_5_prepare_says_what_batch_size_means(capsys):
    rt, model, opt = _setup(strategy="dp", devices=["cpu", "cpu"])
    rt.prepare(model, opt, DataLoader(_data(), batch_size=8))
    assert "global batch 8 = 4 per device x 2 devices" in capsys.readouterr().err
    # per-rank sizes that differ: tests/dist/test_silent_mistakes_dist.py (agreed at prepare)


def test_ten_mistakes_6_no_module_prefix_saved_and_a_prefixed_state_loads(tmp_path):
    rt, model, opt = _setup(strategy="ddp")
    model, opt = rt.prepare(model, opt)
    assert sorted(model.state_dict()) == ["bias", "weight"]
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "torch.pt")
    fresh = nn.Linear(4, 3)
    rt.load(tmp_path / "torch.pt", model=fresh)
    assert torch.equal(fresh.weight, rw.unwrap_model(model).weight)


def test_ten_mistakes_7_rt_print_is_print0_and_rt_save_is_called_on_every_rank(tmp_path):
    rt, model, _ = _setup()
    assert rt.print is rw.print0
    assert rt.save(tmp_path / "ckpt", model=model).name == "ckpt-00000000.pt"  # no rank branch


# rows 8 and 9 at run time: tests/dist/test_silent_mistakes_dist.py; row 10 above
# (test_a_second_run_into_a_checkpoint_folder_without_loading_it_warns).
