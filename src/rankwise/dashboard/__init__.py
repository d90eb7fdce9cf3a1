"""Where people watch a job: ``rankwise top`` in the terminal and the web page of
``rankwise run --dashboard`` / ``rankwise dashboard``, both drawn from the run directory's
``steps.jsonl`` and ``events.jsonl`` (``records`` reads them, ``summary`` computes what both
views show; docs/slow.md)."""
