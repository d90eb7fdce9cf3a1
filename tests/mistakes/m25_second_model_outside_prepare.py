# https://github.com/k2-fsa/icefall/issues/226
# mistake: a second module (a decoder) trained by its own optimizer outside `rt.prepare`: its copies drift apart per rank
# expect: check RW019
import torch

import rankwise as rw

rt = rw.init()
torch.manual_seed(rt.rank)
encoder = torch.nn.Linear(8, 8)
decoder = torch.nn.Linear(8, 1)
encoder, opt = rt.prepare(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1))
dec_opt = torch.optim.SGD(decoder.parameters(), lr=0.1)
for step in range(3):
    decoder(encoder(torch.randn(4, 8))).pow(2).mean().backward()
    opt.step()
    dec_opt.step()
    opt.zero_grad()
    dec_opt.zero_grad()
model = torch.nn.Sequential(rw.unwrap_model(encoder), decoder)
rt.save("ckpt", model=model)
