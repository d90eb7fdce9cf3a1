# https://github.com/huggingface/accelerate/issues/575
# mistake: `rt.prepare_loader(DataLoader(test))` on 101 samples, gathered for the metric: a padded duplicate is counted (102)
# expect: check RW023
# expect-run: over 101 samples | evaluation: each sample once ; fix: evaluation=False pads
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

rt = rw.init()
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
test = TensorDataset(torch.randn(101, 8), torch.randint(0, 2, (101,)))
test_loader = rt.prepare_loader(DataLoader(test, batch_size=16))
hits = []
with torch.no_grad():
    for x, y in test_loader:
        hits.append(rw.gather_for_metrics(model(x).argmax(1) == y))
hits = torch.cat(hits)
rt.print(f"accuracy {hits.float().mean():.3f} over {len(hits)} samples")
