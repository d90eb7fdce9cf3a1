"""``python -m rankwise.check train.py``."""

from .cli import main

raise SystemExit(main())
