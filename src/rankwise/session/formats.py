"""``rt.save``/``rt.load``'s choice of format: the strategy registry's, a mesh's, or the caller's.

A strategy that shards state (``Strategy.checkpoint == "sharded"``: the ZeRO stages) saves in
torch DCP's folder format, every rank writing its own shards; so does any mesh with tensor or
pipeline ranks (the model is split over them), and a model that is sharded whatever the
strategy (a ``rw.ShardedDataParallel`` or ``rw.tensor_parallel`` built by hand). The others
write one file from rank 0, and so does the ``PipelineModel`` ``rt.prepare`` builds under a
pipeline mesh: its stages gather the whole model and the one-process optimizer state
(``pipeline/state.py``), which any stage layout, or one process, loads. ``rt.save(..., sharded=True/False)`` overrides the choice.
``background=True`` returns once the state is copied to host memory and writes it in a thread
(``checkpoint/background.py``). Loading looks at what the path holds, so either format loads
under any strategy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint import files
from ..checkpoint.api import check_flag, load_checkpoint, resolve, save_checkpoint
from ..checkpoint.sharded.dcp_meta import is_sharded
from ..checkpoint.sharded.pieces import find_engine
from ..parallel.tensor.state import has_split_layers
from ..pipeline.state import pipeline_in
from ..training.loop import full_states

if TYPE_CHECKING:
    from ..runtime import Runtime


def saves_sharded(rt: Runtime, model: Any = None) -> bool:
    """The default of ``rt.save``: the registry's format; sharded on a split mesh, and for a
    model that is sharded whatever the strategy (a ``ShardedDataParallel`` or tensor-parallel
    layers built by hand)."""
    if model is not None and pipeline_in(model) is not None:
        return False  # one file of the whole model: see the module's docstring
    if rt.strategy_spec.checkpoint == "sharded":
        return True
    mesh = rt.mesh
    if mesh is not None and (mesh.sizes["tensor"] > 1 or mesh.sizes["pipeline"] > 1):
        return True
    return model is not None and (find_engine(model) is not None or has_split_layers(model))


def save(rt: Runtime, path: str | Path, sharded: bool | None, background: bool,
         kwargs: dict[str, Any]) -> Any:  # fmt: skip
    """Save in the chosen format, now or in the background. Sync point: all ranks."""
    files.check_arguments(path, kwargs.get("model"), kwargs.get("optimizer"), saving=True,
                          epoch=kwargs.get("epoch"), keep_last=kwargs.get("keep_last", 3))  # fmt: skip
    check_flag("sharded", sharded, where="rt.save()", optional=True)
    check_flag("background", background, where="rt.save()")
    sharded = saves_sharded(rt, kwargs.get("model")) if sharded is None else bool(sharded)
    if background:
        from ..checkpoint.background import save_in_background

        return save_in_background(path, sharded=sharded, **_whole_unless(sharded, kwargs))
    return save_checkpoint(path, sharded=sharded, **_whole_unless(sharded, kwargs))


def load(path: str | Path, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Load either format: a sharded folder with each rank's own pieces, a file with the
    tensor-parallel slicing of ``full_states``. No sync point."""
    files.check_arguments(path, kwargs.get("model"), kwargs.get("optimizer"), saving=False)
    sharded = is_sharded(resolve(path))
    return load_checkpoint(path, **_whole_unless(sharded, kwargs))


def _whole_unless(sharded: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One file holds the unsplit model (``full_states``); a sharded folder places each
    tensor-parallel slice in its full tensor itself."""
    return kwargs if sharded else full_states(kwargs)
