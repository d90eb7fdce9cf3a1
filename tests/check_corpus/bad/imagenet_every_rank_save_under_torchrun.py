"""The shape of pytorch/examples imagenet/main.py: mp.spawn, DDP or DP chosen at run time. Its
save guard `not args.multiprocessing_distributed or ...` holds on every rank under torchrun
(only mp.spawn sets the flag), so every rank writes the checkpoint; under mp.spawn on several
nodes `args.rank % ngpus_per_node == 0` is the local rank: once per node (RW015)."""

import argparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--multiprocessing-distributed", action="store_true")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
parser.add_argument("--rank", type=int, default=0)
parser.add_argument("--world-size", type=int, default=1)


def save_checkpoint(state, filename="checkpoint.pth.tar"):
    torch.save(state, filename)  # expect: RW008  # expect: RW015


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    if args.distributed:
        args.rank = args.rank * ngpus_per_node + gpu
        dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    model = nn.Linear(8, 2)
    if args.distributed:
        torch.cuda.set_device(args.gpu)
        model.cuda(args.gpu)
        args.batch_size = int(args.batch_size / ngpus_per_node)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    else:
        model = torch.nn.DataParallel(model).cuda()
    dataset = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    train_sampler = DistributedSampler(dataset) if args.distributed else None
    train_loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=(train_sampler is None), sampler=train_sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            loss = nn.functional.cross_entropy(model(x.cuda(args.gpu)), y.cuda(args.gpu))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if not args.multiprocessing_distributed or (args.multiprocessing_distributed and args.rank % ngpus_per_node == 0):
            save_checkpoint({"epoch": epoch + 1, "state_dict": model.module.state_dict()})


def main():
    args = parser.parse_args()
    args.distributed = args.world_size > 1 or args.multiprocessing_distributed
    ngpus_per_node = torch.cuda.device_count()
    if args.multiprocessing_distributed:
        args.world_size = ngpus_per_node * args.world_size
        mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))
    else:
        main_worker(0, ngpus_per_node, args)


if __name__ == "__main__":
    main()
