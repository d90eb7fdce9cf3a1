# Evaluation through an exact loader (each sample once); training over a padding one is fine.
import torch
from torch.utils.data import DataLoader, TensorDataset
import rankwise as rw

rt = rw.init()
model = torch.nn.Linear(8, 2)
ds = TensorDataset(torch.randn(101, 8), torch.randint(0, 2, (101,)))
model, opt, train = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ds, batch_size=16))
for x, y in train:
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
test_loader = rt.prepare_loader(DataLoader(ds, batch_size=16), evaluation=True)
hits = []
for x, y in test_loader:
    hits.append(rw.gather_for_metrics(model(x).argmax(1) == y))
