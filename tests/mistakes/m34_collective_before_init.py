# https://github.com/Peterande/D-FINE/issues/134
# mistake: a collective is used before the process group exists ("Default process group has not been initialized")
# expect-run: rw.init ; fix: rw.init
import torch

import rankwise as rw

loss = rw.all_reduce_mean(torch.tensor(1.0))
rt = rw.init()
