"""In-memory replicas: lose a machine, lose almost nothing (docs/elastic.md).

Every ``every`` steps each rank's training state (what ``rt.save`` captures) is copied into its
host's RAM and into a buddy's on another host; after torch's elastic agent restarts the
survivors at a smaller (or, when a host returns, larger) world, ``restore`` resumes from the
newest whole step without reading the disk, keeping the global batch by the accumulation.
``blob`` (the format), ``plan`` (pure decisions), ``store`` (the host's tmpfs folder),
``exchange`` (the collectives), ``interval`` (``every="auto"``), ``replicator`` (``Replicas``).
"""

from .replicator import DEFAULT_EVERY, Replicas, ResizeEvent, describe

__all__ = ["DEFAULT_EVERY", "Replicas", "ResizeEvent", "describe"]
