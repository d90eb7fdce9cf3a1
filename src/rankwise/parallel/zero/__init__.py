"""ShardedDataParallel (ZeRO stages 1-3): each rank keeps 1/N of optimizer state, gradients and
(stage 3) parameters.

- ``layout``: pure flat shard layout (units, padding, each rank's slice);
- ``shard_unit``, ``shard_comm``: one unit's buffers and its reduce-scatter / all-gather;
- ``sharded``: the module wrapper; ``stage3``: gather before a module runs, free after;
- ``wrap``: stage 3's wrap policy (which modules are one unit); ``grad_norm``: the global
  gradient norm over the shards, in float64;
- ``sharded_optim``: the user's optimizer stepping on this rank's shards;
- ``memory_plan``: bytes per rank under each stage, and which stage fits a device.
"""
