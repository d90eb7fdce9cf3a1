# The one-call API used as meant: what trains went through rt.prepare; what does not train may not.
import rankwise as rw
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Trainer:
    def __init__(self, rt, model, opt, loader):
        self.model, self.opt, self.loader = rt.prepare(model, opt, loader)
        self.head_opt = torch.optim.SGD(self.model.module.parameters(), lr=0.1)

    def epoch(self):
        for x, y in self.loader:
            F.mse_loss(self.model(x), y).backward()
            self.opt.step()
            self.opt.zero_grad()


def main():
    rt = rw.init()
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    generator = torch.nn.Linear(4, 4)
    critic = torch.nn.Linear(4, 1)
    g_opt = torch.optim.Adam(generator.parameters(), lr=1e-3)  # built before prepare: fine
    generator, g_opt = rt.prepare(generator, g_opt)
    critic = rt.prepare(critic)
    c_opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    teacher = torch.nn.Linear(4, 1)  # never trained: needs no prepare
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, opt, loader = rt.prepare(torch.nn.Linear(4, 1), None, loader)
    val_loader = DataLoader(data, batch_size=16)  # evaluation only: no backward
    own = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    stream = rw.loader(data, batch_size=8, shuffle=True)
    for epoch in range(2):
        loader.set_epoch(epoch)
        own.sampler.set_epoch(epoch)
        for batches in (loader, own, stream):
            for x, y in batches:
                fake = generator(x)
                (critic(fake).mean() + F.mse_loss(teacher(x), y)).backward()
                g_opt.step()
                c_opt.step()
        with torch.no_grad():
            for x, y in val_loader:
                rt.print(F.mse_loss(critic(generator(x)), y))
    Trainer(rt, torch.nn.Linear(4, 1), None, DataLoader(data, batch_size=8)).epoch()


if __name__ == "__main__":
    main()
