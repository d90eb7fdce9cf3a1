# https://github.com/huggingface/accelerate/issues/2375
# mistake: each rank averages its own evaluation losses and rt.print shows rank 0's as "Average Evaluation Loss"
# expect: check RW020
# expect-run: Average Evaluation Loss | rank 0's value | ranks differ ; fix: mean
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw

rt = rw.init()
model = torch.nn.Linear(8, 1)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
val = rt.prepare_loader(DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=8), evaluation=True)
eval_losses = []
with torch.no_grad():
    for x, y in val:
        eval_losses.append(torch.nn.functional.mse_loss(model(x), y).item())
eval_loss = sum(eval_losses) / len(eval_losses)
rt.print(f"Average Evaluation Loss: {eval_loss:.4f}")
