"""DistributedDataParallel against torch's, in the same two ranks, where torch's own c10d tests
found differences (docs/ddp.md, "torch's own DDP tests"):

- a BatchNorm model called twice before one backward (siamese, ``D(real) + D(fake)``): the
  per-forward buffer broadcast must not bump autograd's version counter (Gloo and shared memory);
- activation checkpointing, reentrant or not, with/without ``static_graph`` and
  ``find_unused_parameters``, twice, with shared weights, dynamic: torch's gradients, or torch's
  refusal ("Expected to mark a variable ready only once");
- sparse gradients (``nn.EmbeddingBag(sparse=True)``), with and without a communication hook;
- ``_get_ddp_logging_data()`` and torch's wording for the errors its tests match.

Each part runs in a spawned world of 2 of its own; the parent compares.
No ``from __future__ import annotations`` here: the hooks' annotations must be real objects, as
torch's annotation checks compare them.
"""

import copy
import re

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.checkpoint import checkpoint

import rankwise as rw
from rankwise.testing import run_distributed

TORCH = nn.parallel.DistributedDataParallel
TWICE = "Expected to mark a variable ready only once"


def _arrays(tensors) -> list[np.ndarray]:
    return [t.detach().clone().numpy() for t in tensors]


# -- 1. two forwards, one backward ------------------------------------------------------------


def _bn_net(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 2))


def _two_forwards(rank: int) -> dict:
    out = {}
    # width 512: a 1 MiB bucket, so shared_memory_reduce=True really averages through /dev/shm
    engines = {
        "torch": (TORCH, {}, 8),
        "ours": (rw.DistributedDataParallel, {"shared_memory_reduce": False}, 8),
        "torch_wide": (TORCH, {}, 512),
        "ours_shm": (rw.DistributedDataParallel, {"shared_memory_reduce": True}, 512),
    }
    for name, (cls, kwargs, width) in engines.items():
        d, g = cls(_bn_net(width), **kwargs), cls(nn.Linear(3, width), **kwargs)  # D and G
        opt = torch.optim.SGD([*d.parameters(), *g.parameters()], lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            real, z = torch.randn(6, width, generator=gen), torch.randn(6, 3, generator=gen)
            opt.zero_grad()
            siamese = (d(real) - d(real.flip(0))).pow(2).mean()  # the same net twice
            gan = d(real).mean() - d(g(z)).mean()  # D(real) + D(fake)
            (siamese + gan).backward()
            opt.step()
        out[name] = _arrays([*d.module.parameters(), *d.module.buffers(), *g.module.parameters()])
    return out


# -- 2. activation checkpointing --------------------------------------------------------------


class Once(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.l1, self.l2, self.reentrant = nn.Linear(20, 20), nn.Linear(20, 20), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.l2, self.l1(x), use_reentrant=self.reentrant)


class Twice(Once):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.l2, self.l1(x), use_reentrant=self.reentrant)
        return checkpoint(self.l2, x, use_reentrant=self.reentrant)


class TwiceShared(Twice):
    def __init__(self, reentrant: bool) -> None:
        super().__init__(reentrant)
        self.l1.weight = self.l2.weight


class Dynamic(Once):
    def __init__(self, reentrant: bool) -> None:
        super().__init__(reentrant)
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.l1 if self.count % 2 else self.l2
        self.count += 1
        return checkpoint(layer, x, use_reentrant=self.reentrant)


class Whole(nn.Module):
    """Two layers sharing a weight; the whole wrapped model runs inside checkpoint()."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(20, 20), nn.Linear(20, 20))
        self.seq[0].weight = self.seq[1].weight
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


CASES = [
    (model, reentrant, static, unused)
    for model in (Once, Twice, TwiceShared, Dynamic, Whole)
    for reentrant in (True, False)
    for static in (False, True)
    for unused in (False, True)
    if model is not Dynamic or (unused and not static)  # torch's dynamic cases
]


def _checkpointed(cls, model_cls, reentrant, static, unused, rank) -> list | str:
    torch.manual_seed(31415)
    model = model_cls(reentrant)
    ddp = cls(copy.deepcopy(model), find_unused_parameters=unused, static_graph=static)
    gen = torch.Generator().manual_seed(7)
    x, y = torch.rand(32, 20, generator=gen, requires_grad=True), torch.randn(32, 20, generator=gen)
    grads = []
    try:
        for _ in range(4):
            ddp.zero_grad(set_to_none=False)
            xs, ys = x[rank * 16 : rank * 16 + 16], y[rank * 16 : rank * 16 + 16]
            out = checkpoint(ddp, xs, use_reentrant=reentrant) if model_cls is Whole else ddp(xs)
            F.mse_loss(out, ys).backward()
            grads += [None if p.grad is None else p.grad.clone() for p in ddp.parameters()]
    except RuntimeError as exc:
        return f"refused: {exc}"
    return [None if g is None else g.numpy() for g in grads]


def _checkpointing(rank: int) -> dict:
    out = {}
    for model_cls, reentrant, static, unused in CASES:
        key = f"{model_cls.__name__} reentrant={reentrant} static={static} unused={unused}"
        out[key] = {
            name: _checkpointed(cls, model_cls, reentrant, static, unused, rank)
            for name, cls in (("torch", TORCH), ("ours", rw.DistributedDataParallel))
        }
    return out


# -- 3. sparse gradients ----------------------------------------------------------------------


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1337)
        self.embedding = nn.EmbeddingBag(10, 10, sparse=True)
        self.head = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(x))


def _sparse(rank: int) -> dict:
    out = {}
    seen: dict[str, list] = {}

    def hook(name: str):
        def allreduce(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            seen.setdefault(name, []).append((bucket.buffer().is_sparse, bucket.buffer().shape[0]))
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] / dist.get_world_size())

        return allreduce

    for with_hook in (False, True):
        for name, cls in (("torch", TORCH), ("ours", rw.DistributedDataParallel)):
            model = cls(Bag())
            if with_hook:
                model.register_comm_hook(None, hook(name))
            gen = torch.Generator().manual_seed(10 + rank)
            grads = []
            for _ in range(2):
                model.zero_grad()
                x, y = torch.randint(0, 10, (3, 2), generator=gen), torch.randint(0, 10, (3,), generator=gen)
                F.cross_entropy(model(x), y).backward()
                emb = model.module.embedding.weight.grad
                grads += [emb.is_sparse, emb.coalesce().to_dense(), model.module.head.weight.grad.clone()]
            out[f"{name} hook={with_hook}"] = [g if isinstance(g, bool) else g.numpy() for g in grads]
    out["hook_saw"] = seen
    return out


# -- 4. logging data and torch's wording ------------------------------------------------------

KEYS = (
    "static_graph", "is_multi_device_module", "find_unused_parameters", "gradient_as_bucket_view",
    "bucket_cap_bytes", "bucket_sizes", "comm_hook", "module_name", "dtypes", "world_size", "rank",
    "num_parameter_tensors", "total_parameter_size_bytes", "backend_name", "broadcast_buffers",
    "device_ids", "output_device", "iteration", "prev_iteration_grad_ready_order_indices",
)  # fmt: skip


def _logged(cls, **kwargs) -> dict:
    torch.manual_seed(0)
    model = cls(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), **kwargs)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
    data = model._get_ddp_logging_data()
    return {k: data.get(k) for k in KEYS}


def _message(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the built-in types it is, and the text torch's tests match
        kinds = [c.__name__ for c in (ValueError, TypeError, RuntimeError) if isinstance(exc, c)]
        return f"{type(exc).__name__}|{','.join(kinds)}|{exc}"
    return "no error"


def _wording(cls) -> dict:
    def model():
        return cls(nn.Linear(2, 2))

    def returns_int(state: object, bucket: dist.GradBucket) -> int:
        return 1

    def not_a_future(state, bucket):
        return 1

    def second_hook():
        m = model()
        m.register_comm_hook(None, default_hooks.allreduce_hook)
        m.register_comm_hook(None, default_hooks.allreduce_hook)

    def at_backward():
        m = model()
        m.register_comm_hook(None, not_a_future)
        m(torch.randn(3, 2)).sum().backward()

    annotated = model()
    out = {
        "annotated": _message(lambda: annotated.register_comm_hook(None, returns_int)),
        "not_callable": _message(lambda: model().register_comm_hook(None, 1)),
        "second": _message(second_hook),
        "not_a_future": _message(at_backward),
    }
    logged = annotated._get_ddp_logging_data()
    out["logged_error"] = (logged.get("has_error"), logged.get("error", ""))
    return out


def _logging(rank: int) -> dict:
    configs = {
        "default": {},
        "options": {"find_unused_parameters": True, "static_graph": True,
                    "gradient_as_bucket_view": True, "bucket_cap_mb": 1.5},
    }  # fmt: skip
    out = {
        f"{name} {impl}": _logged(cls, **kwargs)
        for name, kwargs in configs.items()
        for impl, cls in (("torch", TORCH), ("ours", rw.DistributedDataParallel))
    }
    out["wording torch"] = _wording(TORCH)
    out["wording ours"] = _wording(rw.DistributedDataParallel)
    data = list(range(10))
    out["sampler torch"] = _message(lambda: torch.utils.data.DistributedSampler(data, 2, 5))
    out["sampler ours"] = _message(lambda: rw.DistributedSampler(data, num_replicas=2, rank=5))
    return out


PARTS = {
    "two_forwards": _two_forwards,
    "checkpointing": _checkpointing,
    "sparse": _sparse,
    "logging": _logging,
}


def _in_ranks(name: str) -> dict:
    return PARTS[name](dist.get_rank())


def _part(name: str) -> list[dict]:
    """Run one part in a world of its own (a failure in one part cannot hide another)."""
    return run_distributed(_in_ranks, 2, args=(name,), timeout=300)


def _close(a: list, b: list, tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and np.allclose(x, y, atol=tol))
        for x, y in zip(a, b, strict=True)
    )


def test_batchnorm_called_twice_before_one_backward_trains_like_torch():
    world = _part("two_forwards")
    for res in world:
        assert _close(res["ours"], res["torch"])
        assert _close(res["ours_shm"], res["torch_wide"], 1e-4)
    # replicas hold the same parameters (buffers are rank-local after the last forward, as in torch)
    assert _close(world[0]["ours"][:6], world[1]["ours"][:6], 0)


def test_activation_checkpointing_trains_or_refuses_as_torch_does():
    refused = 0
    for res in _part("checkpointing"):
        for case, outcome in res.items():
            theirs, ours = outcome["torch"], outcome["ours"]
            if isinstance(theirs, str):  # torch refuses: so do we, with its reason first
                assert isinstance(ours, str) and TWICE in theirs and TWICE in ours, (case, ours)
                assert "Fix:" in ours, case
                refused += 1
            else:
                assert not isinstance(ours, str), (case, ours)
                assert _close(ours, theirs), case
    # per rank, torch refuses: reentrant Once and Dynamic with find_unused_parameters, and
    # reentrant Twice/TwiceShared without static_graph (with and without find_unused)
    assert refused == 2 * 6


def test_sparse_gradients_are_averaged_like_torch():
    world = _part("sparse")
    for res in world:
        for hook in (False, True):
            ours, theirs = res[f"ours hook={hook}"], res[f"torch hook={hook}"]
            assert ours[0] is True and ours[3] is True  # .grad stays sparse
            assert _close([x for x in ours if not isinstance(x, bool)],
                          [x for x in theirs if not isinstance(x, bool)])  # fmt: skip
        assert res["hook_saw"]["ours"].count((True, 10)) == res["hook_saw"]["torch"].count((True, 10)) == 2
    assert _close(world[0]["ours hook=False"][1:2], world[1]["ours hook=False"][1:2], 0)


def test_logging_data_and_error_wording_match_torch():
    for res in _part("logging"):
        for config in ("default", "options"):
            assert res[f"{config} ours"] == res[f"{config} torch"], config
        ours, theirs = res["wording ours"], res["wording torch"]
        for case in ("annotated", "not_callable", "second", "not_a_future"):
            kind, _, text = theirs[case].split("|", 2)
            assert kind in ours[case].split("|")[1].split(","), (case, ours[case])
            # torch's text without its C++ trace or pybind11's preamble
            torch_text = text.split("\nException raised from")[0].strip()
            torch_text = re.sub(r"^Unable to cast .*?details\)\. ", "", torch_text)
            assert torch_text.split(" but got")[0] in ours[case], (case, ours[case], torch_text)
            assert "Fix:" in ours[case], case
        assert ours["logged_error"][0] == 1 and "return annotation" in ours["logged_error"][1]
        torch_sampler = res["sampler torch"].split("|", 2)[2]
        assert torch_sampler in res["sampler ours"] and "Fix:" in res["sampler ours"]
