"""``python -m rankwise.bench``: the ``rankwise bench`` command."""

from .cli import main

raise SystemExit(main())
