"""ZeRO's collectives: reduce-scatter and all-gather over one flat buffer (``shard_comm``), the same
node first across nodes (``hier_comm``), and the global gradient norm over every rank's shards
(``grad_norm``).
"""
