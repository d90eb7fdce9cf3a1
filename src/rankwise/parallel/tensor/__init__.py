"""Tensor parallelism: split the layers themselves over a group of ranks (Megatron-style).

- ``collectives``: f / g / all-gather / reduce-scatter as autograd functions;
- ``shards``: which slice of a full tensor each rank holds (pure);
- ``layers``: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding;
- ``loss``: vocab-parallel cross-entropy (no gather of the logits);
- ``plan``: ``tensor_parallel(model, plan, group)`` by module-name patterns;
- ``state``: mesh-independent checkpoints (full tensors in the file, optimizer state too);

``rankwise.models.GPT`` with ``rankwise.models.GPT_PLAN`` is a small GPT written to be split.

docs/model-parallel.md explains when to use it and how it composes with data parallelism.
"""

from .collectives import (
    copy_to_parallel,
    gather_from_parallel,
    gather_from_sequence,
    reduce_from_parallel,
    reduce_scatter_to_parallel,
    scatter_to_parallel,
)
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .loss import vocab_parallel_cross_entropy
from .plan import Column, Divide, Row, Vocab, sync_replicated_grads, tensor_parallel
from .state import FullOptimState, FullState, full_state_dict, load_full_state_dict

__all__ = [
    "Column",
    "ColumnParallelLinear",
    "Divide",
    "FullOptimState",
    "FullState",
    "Row",
    "RowParallelLinear",
    "Vocab",
    "VocabParallelEmbedding",
    "copy_to_parallel",
    "full_state_dict",
    "gather_from_parallel",
    "gather_from_sequence",
    "load_full_state_dict",
    "reduce_from_parallel",
    "reduce_scatter_to_parallel",
    "scatter_to_parallel",
    "sync_replicated_grads",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]
