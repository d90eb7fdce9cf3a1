# https://github.com/huggingface/transformers/pull/4493
# mistake: DataParallel with `batch_size = batch_size // n_gpu`: DP splits each batch again, each device gets batch/N²
# expect: check RW012
import torch
from torch.utils.data import DataLoader, TensorDataset

batch_size = 32
n_gpu = torch.cuda.device_count()
model = torch.nn.DataParallel(torch.nn.Linear(8, 1))
loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=batch_size // n_gpu)
