# https://github.com/NVIDIA/Megatron-LM/pull/521
# mistake: the process group is initialised by hand, then again by a helper (`trying to initialize the default process group twice`)
# expect: check RW002
import torch.distributed as dist


def initialize():
    dist.init_process_group("gloo")


dist.init_process_group("gloo")
initialize()
