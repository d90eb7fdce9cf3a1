"""The first ``set_epoch`` after resuming from a checkpoint taken at the end of an epoch.

Such a checkpoint resumes at the start of the next epoch (``rw.load_checkpoint`` returns that
epoch; docs/checkpoints.md). Two loops get it wrong, loudly: one that asks for the finished
epoch again (its pass is empty) and one that adds its own ``+ 1`` on top (an epoch is skipped).
"""

from __future__ import annotations

import warnings


def check_first_epoch(epoch: int, finished: int) -> bool:
    """Warn when ``epoch`` is not the one after ``finished``; True when it is ``finished``."""
    if epoch == finished:
        warnings.warn(
            f"loader.set_epoch({epoch}): the checkpoint this loader resumed from was saved "
            f"after epoch {epoch} had finished, so this pass is empty. Fix: start the epoch "
            f"loop at {epoch + 1}, the 'epoch' rw.load_checkpoint returns (or loader.epoch "
            "right after loading).",
            UserWarning,
            stacklevel=4,
        )
    elif epoch > finished + 1:
        skipped = f"epoch {finished + 1}" if epoch == finished + 2 else f"epochs {finished + 1}-"
        skipped += "" if epoch == finished + 2 else str(epoch - 1)
        warnings.warn(
            f"loader.set_epoch({epoch}) right after resuming: the checkpoint was saved after "
            f"epoch {finished} had finished, so {skipped} is never trained on. Fix: start the "
            f"epoch loop at {finished + 1}: the 'epoch' rw.load_checkpoint returns is already "
            "the epoch to resume in (no + 1 needed).",
            UserWarning,
            stacklevel=4,
        )
    return epoch == finished
