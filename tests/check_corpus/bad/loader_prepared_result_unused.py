# rt.prepare got the loader, but the loop reads the original: the prepared one is dropped.
import rankwise as rw
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def train(model, opt, batches):
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


rt = rw.init(strategy="ddp")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)  # expect: RW018
model, opt, _ = rt.prepare(model, opt, loader)
train(model, opt, loader)
