# rt.prepare wraps one model; the optimizer steps another, whose copies drift apart per rank.
import rankwise as rw
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

rt = rw.init()
net = torch.nn.Linear(4, 1)
student = torch.nn.Linear(4, 1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
net, _, loader = rt.prepare(net, None, loader)
opt = torch.optim.AdamW(student.parameters(), lr=1e-3)  # expect: RW019
for x, y in loader:
    F.mse_loss(student(x), y).backward()
    opt.step()
    opt.zero_grad()
rt.save("ckpt/", model=student)
