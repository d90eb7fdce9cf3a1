"""On the path of the processes a fast-tier test starts (tests/fast_tier.py): at exit, each
writes the rankwise modules it imported into the folder RANKWISE_IMPORT_LOG names."""

import atexit
import os
import sys

_FOLDER = os.environ.get("RANKWISE_IMPORT_LOG")


def _write() -> None:
    names = sorted(m for m in sys.modules if m.split(".")[0] == "rankwise")
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.split(".")[0] == "rankwise":  # python -m rankwise...
        names.append(spec.name)
    try:
        with open(os.path.join(_FOLDER, f"process-{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(names))
    except OSError:  # the test's folder is gone: nothing to record
        pass


if _FOLDER:
    atexit.register(_write)
