# torch.load without weights_only=True.
import torch

model = torch.nn.Linear(4, 1)
state = torch.load("model.pt", map_location="cpu")  # expect: RW011
model.load_state_dict(state)
