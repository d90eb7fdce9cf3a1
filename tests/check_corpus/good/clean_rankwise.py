"""The DESIGN's user view: rankwise handles devices, sampling, rank-0 output and checkpoints."""

import rankwise as rw
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def main():
    rt = rw.init()
    model = rw.DistributedDataParallel(torch.nn.Linear(16, 4).to(rt.device))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    train_set = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    loader = rw.loader(train_set, global_batch_size=64, shuffle=True)
    log = rw.get_logger("train")
    for epoch in range(10):
        loader.set_epoch(epoch)
        for x, y in rw.progress(loader):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        rw.print0(f"epoch {epoch} loss {rw.all_reduce_mean(loss):.4f}")
        log.info("epoch %d done", epoch)
        rw.save_checkpoint("ckpt/", model=model, optimizer=opt, loader=loader, epoch=epoch)
    if rt.is_master:
        torch.save(model.state_dict(), "final.pt")  # rankwise's DDP state_dict has no module. prefix
    rw.barrier()


if __name__ == "__main__":
    main()
