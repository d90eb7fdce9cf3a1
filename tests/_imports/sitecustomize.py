"""On the path of the processes a fast-tier test starts (tests/fast_tier.py): at exit, each
writes the rankwise modules it imported into the folder RANKWISE_IMPORT_LOG names.

A rank forked from a fork server (``rankwise.testing``'s ``forkserver`` start method) ends with
``os._exit``, after multiprocessing's finalizers: it never runs ``atexit``. So the server, which
loaded this module once, registers an after-fork hook, and each fork writes its list from a
finalizer. The folder is read when the list is written: a fork takes the environment of the
test that started it, not the server's."""

import atexit
import os
import sys

_RUN = os.environ.get("RANKWISE_FAST_TIER_LOG")  # set for a whole fast run


def _write() -> None:
    folder = os.environ.get("RANKWISE_IMPORT_LOG")
    if not folder:
        return
    names = sorted(m for m in sys.modules if m.split(".")[0] == "rankwise")
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.split(".")[0] == "rankwise":  # python -m rankwise...
        names.append(spec.name)
    try:
        with open(os.path.join(folder, f"process-{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(names))
    except OSError:  # the test's folder is gone: nothing to record
        pass


class _ForkHook:
    """Kept alive here: multiprocessing holds after-fork hooks by weak reference."""

    def __call__(self, _self: object) -> None:
        from multiprocessing import util

        util.Finalize(None, _write, exitpriority=0)


if _RUN or os.environ.get("RANKWISE_IMPORT_LOG"):
    atexit.register(_write)
    if _RUN:
        from multiprocessing import util as _util

        _HOOK = _ForkHook()
        _util.register_after_fork(_HOOK, _HOOK)
