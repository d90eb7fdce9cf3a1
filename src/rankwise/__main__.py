"""``python -m rankwise ...`` is the ``rankwise`` command."""

import sys

from .cli import main

sys.exit(main())
