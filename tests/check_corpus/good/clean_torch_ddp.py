"""A correct torchrun DDP script: every pitfall of docs/pitfalls.md avoided the torch way."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    # Accepted for torch.distributed.launch; the environment is the source of truth.
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    return p.parse_args()


def train_one_epoch(model, loader, opt, device):
    model.train()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.detach()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    local_rank = args.local_rank
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if os.path.exists("init.pt"):
        model.load_state_dict(torch.load("init.pt", map_location="cpu", weights_only=True))
    model.to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    dataset = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, shuffle=False)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss = train_one_epoch(model, loader, opt, device)
        dist.all_reduce(loss)
        if rank == 0:
            print(f"epoch {epoch} mean loss {loss.item() / dist.get_world_size():.4f}")
            torch.save(model.module.state_dict(), "model.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
