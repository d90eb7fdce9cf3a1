# https://github.com/facebookresearch/detectron2/issues/2486
# mistake: a head frozen when the model is wrapped is unfrozen at a later iteration (`model.module...requires_grad = True`): its gradients have no bucket, each rank trains its own copy
# expect-run: requires_grad=False when DistributedDataParallel was built | head.weight ; fix: set requires_grad before wrapping
import torch

import rankwise as rw


class Detector(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def unfreeze_head(self) -> None:
        for p in self.head.parameters():
            p.requires_grad = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


rt = rw.init()
net = Detector()
net.head.requires_grad_(False)
model = rw.DistributedDataParallel(net)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for iteration in range(4):
    if iteration == 2:
        model.module.unfreeze_head()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
