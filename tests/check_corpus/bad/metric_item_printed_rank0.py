# Accuracy counted on each rank's share with .item(), printed by rank 0 as the job's.
import torch
import rankwise as rw
from torch.utils.data import DataLoader, TensorDataset

rt = rw.init()
model, opt = rt.prepare(torch.nn.Linear(8, 2), None)
test = rt.prepare_loader(DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=8), evaluation=True)
correct = total = 0
with torch.no_grad():
    for x, y in test:
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
accuracy = correct / total
if rt.rank == 0:
    print(f"test accuracy {accuracy:.3f}")  # expect: RW020
