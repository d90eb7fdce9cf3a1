"""Every rule, in id order. Add a rule: write it in the module of its topic, list it here,
document it in docs/check.md and give it a bad and a good script in tests/check_corpus/."""

from __future__ import annotations

from ..findings import Rule
from .data import (
    ddp_without_distributed_sampler,
    dp_batch_size,
    missing_set_epoch,
    sampler_with_shuffle,
)
from .evaluation import batchnorm_small_batch, evaluation_loader_pads
from .metrics import all_reduce_sum_printed, unreduced_metric_printed
from .model import ddp_before_device, torch_load_without_weights_only, wrapped_state_dict_saved
from .multinode import global_rank_as_device, init_rank_from_local_rank, save_guarded_by_local_rank
from .process_group import init_process_group_twice, local_rank_without_env
from .ranks import collective_in_rank_branch, print_without_rank_guard, save_without_rank_guard
from .session import loader_not_prepared, model_outside_prepare
from .sharded import sharded_state_in_rank_branch
from .training import clip_before_unscale, resume_decided_per_rank

RULES: tuple[Rule, ...] = tuple(
    sorted(
        (
            ddp_before_device,
            init_process_group_twice,
            sampler_with_shuffle,
            ddp_without_distributed_sampler,
            missing_set_epoch,
            wrapped_state_dict_saved,
            print_without_rank_guard,
            save_without_rank_guard,
            collective_in_rank_branch,
            local_rank_without_env,
            torch_load_without_weights_only,
            dp_batch_size,
            global_rank_as_device,
            init_rank_from_local_rank,
            save_guarded_by_local_rank,
            clip_before_unscale,
            resume_decided_per_rank,
            loader_not_prepared,
            model_outside_prepare,
            unreduced_metric_printed,
            all_reduce_sum_printed,
            sharded_state_in_rank_branch,
            evaluation_loader_pads,
            batchnorm_small_batch,
        ),
        key=lambda r: r.id,
    )
)
