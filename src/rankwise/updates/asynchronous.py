"""Asynchronous updates through a parameter server, with bounded staleness.

Each worker's ``step()`` pushes its gradient to the server and receives fresh parameters back;
it never waits for the other workers, only (under a staleness bound) for the slowest one to
catch up. The server runs in background threads of rank 0, which trains too, so the same script
runs on every rank; or on a dedicated rank that only serves.
"""

from __future__ import annotations

import contextlib
import queue
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError, DistributedError, RuntimeStateError
from ..parallel.agreement import verify_same_model
from ..parallel.optimizers import rebuild_optimizer
from .base import UpdateRule
from .gate import StalenessGate
from .protocol import Kind, LocalChannel, Message, WireChannel, text_message
from .server import ParameterServer, ServerStats


class AsyncUpdates(UpdateRule):
    """``step()`` = push this rank's gradient to the parameter server, load what it sends back.

    Sync points: all ranks at construction (a process group for the server's traffic is made)
    and at ``close()`` (the final parameters are sent once every worker has finished).
    ``step()`` itself waits only for the server, and, under ``staleness=s``, for the slowest
    worker when this one is ``s`` updates ahead.
    """

    name = "async"
    apart = True  # each worker steps on the parameters the server last sent it

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        staleness: int | None = None,
        server_rank: int = 0,
        dedicated_server: bool = False,
        timeout: float | None = None,
        stall_timeout: float = 8.0,
    ) -> None:
        StalenessGate((), staleness)  # validates the bound on every rank, before any traffic
        super().__init__(model, optimizer)
        world = self.runtime.world_size
        _check_placement(server_rank, dedicated_server, world)
        self.staleness_bound = staleness
        self.server_rank = server_rank
        self.workers = [r for r in range(world) if not (dedicated_server and r == server_rank)]
        self.timeout = self.runtime.timeout.total_seconds() if timeout is None else timeout
        if not isinstance(self.timeout, int | float) or self.timeout <= 0:
            raise ConfigError(
                f"async: timeout={timeout!r} must be a positive number of seconds",
                fix="pass e.g. timeout=300 (the longest a worker may go without a step), "
                "or leave it unset to use the runtime's.",
            )
        _check_seconds("stall_timeout", stall_timeout, "pass e.g. stall_timeout=8 (how long "
                       "a reply may wait for its worker to receive it before that worker is "
                       "dropped), or leave it unset.")  # fmt: skip
        self.stall_timeout = float(stall_timeout)
        self.staleness: list[int] = []
        """Staleness of each of this worker's gradients when the server applied it, in order."""
        self._version = 0
        self._stopped = False
        self._wire: WireChannel | None = None
        self._local: LocalChannel | None = None
        self._server: ParameterServer | None = None
        if world > 1:  # Sync point: all ranks (new_group is collective)
            # Frames are sized by this rank's model: a rank with another model would make Gloo
            # abort the server (a longer frame) or train on garbage (same size, other shapes).
            verify_same_model(model, None, self.rank)
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
            self._wire = WireChannel(group, self.flat.numel, self.flat.dtype)
        if self.rank == server_rank:
            self._start_server(optimizer)
        if self.is_worker:
            reply = self._request(Message(Kind.PULL, self.rank))
            self._version = reply.version
            self.flat.load_values(reply.payload)
        self._opened()

    def _start_server(self, optimizer: torch.optim.Optimizer) -> None:
        params, server_opt = _server_copy(self.flat.params, optimizer)
        local = self.rank if self.is_worker else None
        self._server = ParameterServer(
            params=params,
            optimizer=server_opt,
            workers=self.workers,
            local_worker=local,
            channel=self._wire,
            bound=self.staleness_bound,
            rank=self.rank,
            timeout=self.timeout,
            stall_timeout=self.stall_timeout,
        )
        self._server.start()
        if local is not None:
            self._local = LocalChannel(self._server.inbox, self._server.local_replies)

    # ---- where this rank stands --------------------------------------------------------------
    @property
    def is_worker(self) -> bool:
        return self.rank in self.workers

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def worker_index(self) -> int:
        """Index among the training ranks; -1 on a dedicated server."""
        return self.workers.index(self.rank) if self.is_worker else -1

    @property
    def max_staleness(self) -> int:
        """Largest staleness of this worker's gradients so far (0 before the first step)."""
        return max(self.staleness, default=0)

    def server_stats(self) -> ServerStats | None:
        """The server's record of every applied gradient; None except on the server rank."""
        return None if self._server is None else self._server.stats()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> None:
        """Push the gradient, wait for the server's reply, load the new parameters."""
        self._check_open()
        if not self.is_worker:
            raise RuntimeStateError(
                f"rank {self.rank} is the dedicated parameter server: it does not train",
                fix="guard the training loop with `if opt.is_worker:` and call opt.close() on "
                "every rank (on the server, close() serves until the workers finish).",
                rank=self.rank,
            )
        grads = self.flat.grads()
        reply = self._request(Message(Kind.PUSH, self.rank, self._version, self.steps, grads))
        self.steps += 1
        self._version = reply.version
        self.staleness.append(reply.aux)
        self.flat.load_values(reply.payload)

    def close(self) -> None:
        """End of training: every rank gets the server's final parameters.

        Sync point: all ranks (the server answers once every worker has closed; on a
        dedicated server rank this is where it serves the whole run).
        """
        if self.closed:
            return
        try:
            if self.is_worker and not self._stopped:
                reply = self._request(Message(Kind.DONE, self.rank))
                self.flat.load_values(reply.payload)
        finally:
            self._stopped = True
            self._join_server()
            self._closed()
        if not self.is_worker:  # a dedicated server ends with the trained model, or the error
            failure = self._server.failure
            if failure is not None:
                raise _stopped_error(failure, self.rank)
            self.flat.load_values(self._server.values())

    def abort(self, exc: BaseException) -> None:
        """This rank failed: tell the server, which stops every other worker at its next step."""
        if self.closed:
            return
        try:
            if self.is_worker and not self._stopped:
                self._notify_abort(f"{type(exc).__name__}: {exc}")
        finally:
            self._stopped = True
            self._join_server()
            self._closed()

    # ---- talking to the server ---------------------------------------------------------------
    def _request(self, msg: Message) -> Message:
        try:
            if self._local is not None:
                reply = self._local.request(msg, self.timeout)
                while reply.kind == Kind.WAIT:  # held back, but the server is alive
                    reply = self._local.next_reply(self.timeout)
            else:
                self._wire.send(self.server_rank, msg)
                reply = self._wire.recv(self.server_rank)
                while reply.kind == Kind.WAIT:
                    reply = self._wire.recv(self.server_rank)
        except (queue.Empty, RuntimeError) as exc:
            self._stopped = True
            raise self._lost_server(exc) from exc
        if reply.kind == Kind.STOP:
            self._stopped = True
            if msg.kind != Kind.DONE:
                self._notify(Message(Kind.BYE, self.rank))
            raise _stopped_error(reply, self.rank)
        return reply

    def _notify(self, msg: Message) -> None:
        if self._local is not None:
            self._local.notify(msg)
        else:
            with contextlib.suppress(RuntimeError):  # the server is gone: nothing to tell
                self._wire.send(self.server_rank, msg)

    def _notify_abort(self, text: str) -> None:
        msg = text_message(Kind.ABORT, self.rank, text)
        if self._local is not None:
            self._local.notify(msg)
            return
        with contextlib.suppress(RuntimeError):  # best effort: the server may be gone already
            self._wire.isend(self.server_rank, msg, timeout=min(self.timeout, 30.0))

    def _lost_server(self, exc: BaseException) -> DistributedError:
        if isinstance(exc, queue.Empty):
            why = f"no reply within {self.timeout:.0f}s"
        else:
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return DistributedError(
            f"async: lost contact with the parameter server on rank {self.server_rank} "
            f"at step {self.steps} ({why})",
            fix=f"read rank {self.server_rank}'s error; if it was only slow, raise timeout= "
            "(a staleness bound makes fast workers wait for the slowest one).",
            rank=self.rank,
        )

    def _join_server(self) -> None:
        if self._server is None:
            return
        # The server ends once every worker is finished: each one closes, fails, or falls
        # silent for longer than the timeout (a dedicated server serves the whole run here).
        while not self._server.join(1.0):
            pass


def asynchronous(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    staleness: int | None = None,
    server_rank: int = 0,
    dedicated_server: bool = False,
    timeout: float | None = None,
    stall_timeout: float = 8.0,
) -> AsyncUpdates:
    """Wrap ``optimizer``: gradients go to a parameter server that applies them as they arrive.

    ``staleness=s`` bounds how many updates late a gradient may be applied (0: synchronous,
    None: no bound). The server runs in threads of ``server_rank``, which trains too unless
    ``dedicated_server=True``. ``timeout`` (s, default the runtime's) bounds every wait.
    ``stall_timeout`` (s): a worker whose reply waits that long for it to receive is dropped,
    and the others train on. Sync point: all ranks (here and at ``close()``).
    """
    return AsyncUpdates(
        model,
        optimizer,
        staleness=staleness,
        server_rank=server_rank,
        dedicated_server=dedicated_server,
        timeout=timeout,
        stall_timeout=stall_timeout,
    )


def _stopped_error(stop: Message, rank: int) -> DistributedError:
    return DistributedError(
        f"training stopped: {stop.text}",
        fix=f"the cause is on rank {stop.rank}: read its error; every other rank stops at its "
        "next step so that nothing hangs.",
        rank=rank,
    )


def _check_seconds(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ConfigError(f"async: {name}={value!r} must be a positive number of seconds", fix=fix)


def _check_placement(server_rank: int, dedicated: bool, world: int) -> None:
    if not 0 <= server_rank < world:
        raise ConfigError(
            f"async: server_rank={server_rank} is not a rank of this job (world size {world})",
            fix=f"use a rank between 0 and {world - 1}; 0 is usual.",
        )
    if dedicated and world < 2:
        raise ConfigError(
            f"async: dedicated_server=True needs at least 2 ranks, the job has {world}",
            fix="start more processes, or let the server rank train too (dedicated_server=False).",
        )


def _server_copy(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """The server's own parameters and a same-class, same-settings, same-state optimizer.

    Rank 0's training thread keeps using the model while the server updates, so they must not
    share tensors.
    """
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = {id(p): c for p, c in zip(params, clones, strict=True)}
    copy = rebuild_optimizer(
        optimizer, [[twin[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    )
    copy.load_state_dict(optimizer.state_dict())
    return clones, copy
