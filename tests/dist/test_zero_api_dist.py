"""ZeRO stage 3 through rt.prepare at world 2 on a nanoGPT-shaped model: one unit per block by
default, the tied embedding / output weight correct, AdamW with decay / no-decay groups, and
generate() through rt.full_parameters equal to one process."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import rankwise as rw
from rankwise.testing import run_distributed

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # the unit tests' TinyGPT
import test_zero_api as t

STEPS, BATCH = 3, 4  # per rank; the oracle sees both ranks' batches at once


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 11, (BATCH, 6), generator=torch.Generator().manual_seed(10 * step + rank))


def _loss(model, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())


def _zero3_gpt():
    rt = rw.init(strategy="zero3")
    torch.set_num_threads(1)
    model = t._gpt()
    model, opt = rt.prepare(model, t._groups(model))
    # One unit per block and group (decay / no-decay): each block gathered on its own.
    blocks = len({id(m) for m in model._unit_modules if isinstance(m, t.Block)})
    for step in range(STEPS):
        _loss(model, _batch(step, rt.rank)).backward()
        rt.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    with rt.full_parameters(model) as bare:
        text = bare.generate(torch.zeros(1, 2, dtype=torch.long), 6)
    try:
        refused = model.module is None
    except rw.ConfigError:
        refused = True
    return state, text, blocks, refused


def test_zero3_nanogpt_shape_with_groups_and_tied_weights_equals_one_process_and_generates():
    ranks = run_distributed(_zero3_gpt, 2, init=False, timeout=120)
    want = t._gpt()
    opt = t._groups(want)
    for step in range(STEPS):
        _loss(want, torch.cat([_batch(step, 0), _batch(step, 1)])).backward()
        torch.nn.utils.clip_grad_norm_(want.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    text = want.generate(torch.zeros(1, 2, dtype=torch.long), 6)
    for state, got_text, blocks, refused in ranks:
        assert blocks == 3 and refused
        for k, v in want.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=2e-6, msg=k)
        assert torch.equal(got_text, text)
