# https://stackoverflow.com/questions/64920956/validation-epoch-end-with-ddp-pytorch-lightning
# mistake: accuracy from `.item()` on each rank, printed on rank 0 as the job's
# expect: check RW020
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

rt = rw.init()
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
test = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
loader = rt.prepare_loader(DataLoader(test, batch_size=16), evaluation=True)
correct = total = 0
with torch.no_grad():
    for x, y in loader:
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
acc = correct / total
if rt.rank == 0:
    print(f"test accuracy {acc:.3f}")
