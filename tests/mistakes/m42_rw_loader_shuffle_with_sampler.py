# https://github.com/AgatheSenellart/MultiVae/issues/33
# mistake: `shuffle=True` hard-coded next to a distributed sampler in the loader
# expect-run: shuffle=True was given together with sampler ; fix: drop shuffle=True
import torch
from torch.utils.data import TensorDataset

import rankwise as rw

rt = rw.init()
ds = TensorDataset(torch.randn(32, 8))
loader = rw.loader(ds, batch_size=8, shuffle=True, sampler=rw.DistributedSampler(ds))
