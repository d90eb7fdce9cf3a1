# https://discuss.pytorch.org/t/distributedsampler/90205
# mistake: the test set goes through torch's DistributedSampler, which pads it: 101 samples on 2 processes count as 102
# expect: check RW023
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 2))
test_set = TensorDataset(torch.randn(101, 8), torch.randint(0, 2, (101,)))
test_loader = DataLoader(test_set, batch_size=16, sampler=DistributedSampler(test_set, shuffle=False))
correct = torch.zeros(2)
with torch.no_grad():
    for x, y in test_loader:
        correct += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
dist.all_reduce(correct)
if dist.get_rank() == 0:
    print(f"accuracy {correct[0] / correct[1]:.3f} over {int(correct[1])} samples")
