# The second init hides in a helper: setup() runs init_process_group, and main calls it twice.
import torch.distributed as dist


def setup(backend):
    dist.init_process_group(backend)


def main():
    setup("gloo")
    dist.barrier()
    setup("gloo")  # expect: RW002


if __name__ == "__main__":
    main()
