"""DataParallel: one process, one thread per device; scatter + replicate + parallel_apply + gather.

- ``scatter_gather``: split nested inputs over devices, gather outputs on the master device;
- ``replicate``: copy the module to each device, keeping autograd links to the master's
  parameters (so gradients flow back to one set of parameters);
- ``parallel_apply``: run the replicas in threads; an error is re-raised tagged with its device;
- ``data_parallel``: the module wrapper composing the four.
"""
