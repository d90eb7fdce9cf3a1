# The counts are summed over the ranks before rank 0 prints the accuracy.
import torch
import torch.distributed as dist
import rankwise as rw
from torch.utils.data import DataLoader, TensorDataset

rt = rw.init()
model, opt = rt.prepare(torch.nn.Linear(8, 2), None)
test = rt.prepare_loader(DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=8), evaluation=True)
counts = torch.zeros(2)
with torch.no_grad():
    for x, y in test:
        counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
dist.all_reduce(counts)
accuracy = (counts[0] / counts[1]).item()
if rt.rank == 0:
    print(f"test accuracy {accuracy:.3f}")
rt.print(f"rank-0 loss {torch.tensor(0.5).item():.3f}")
