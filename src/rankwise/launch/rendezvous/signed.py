"""torch's c10d rendezvous with its state signed: nobody who reaches the store runs code in it.

torch's dynamic rendezvous (what ``--rdzv-backend c10d`` and a one-node job use) keeps its state
as a base64 pickle under ``torch.rendezvous.<run id>`` in the agent's TCPStore, which listens on
every interface without authentication, and unpickles whatever it reads there: anyone who can
reach the port could write a pickle that runs code in the ``rankwise run`` process. The store
and the protocol stay torch's; this module wraps the rendezvous *backend* torch's handler reads
its state through (``C10dRendezvousBackend``) and registers the result in torch's handler
registry as ``rankwise-c10d`` (the launcher uses it wherever ``c10d`` is asked for):

- every state this node writes is sealed: ``MAGIC || HMAC-SHA256(secret, key || state) || state``
  with a per-job secret (generated for a one-node job, given by ``--rdzv-token`` or
  ``RANKWISE_RDZV_TOKEN`` to every node of a larger one);
- every state read back is checked before torch sees it: without a valid seal, or holding any
  pickled global other than the rendezvous state's own classes (checked by a restricted
  unpickler, which also protects a job run without a secret), it is refused with
  ``ForgedRendezvousState`` naming the store key, and the job stops.

A writer who reaches the port can still delete or reset keys and so stop the job (firewall the
port: docs/launcher.md); it can no longer make a node run its code or accept a forged state.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import ipaddress
import pickle
import time
from typing import Any

from ...checkpoint.untrusted import RestrictedUnpickler
from ...errors import DistributedError

BACKEND = "rankwise-c10d"
"""The name the signed backend is registered under in torch's rendezvous handler registry."""
MAGIC = b"rankwise-rdzv-v1:"
_TAG = hashlib.sha256().digest_size
_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_ALLOWED = {
    (_RDZV, "_RendezvousState"),
    (_RDZV, "_NodeDesc"),
    ("datetime", "datetime"),  # the deadline and heartbeats (timezone-aware)
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}
_SECRETS: dict[str, bytes | None] = {}  # run id -> secret, for the launches of this process
LINGER_S = 5.0
"""How long a node that refused the state keeps the store up for the job's other nodes to learn
it (under the 10 s the guarded handler allows a store call): when the store's host refuses
first and leaves at once, the others find the store closed, cannot tell a forgery from the end
of the job, and go on."""


class ForgedRendezvousState(DistributedError):
    """The rendezvous state in the store was not written by a node of this job."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a rendezvous endpoint's host) is this machine's loopback address."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _OnlyRendezvousState(RestrictedUnpickler):
    """An unpickler that finds no global but the rendezvous state's own classes, and sets
    attributes on nothing but their instances (``RestrictedUnpickler``)."""

    BUILD_TYPES = ()  # filled below, from the classes themselves

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"it holds a pickled {module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference")


def _state_types() -> tuple[type, ...]:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    return (dr._RendezvousState, dr._NodeDesc)


def check_pickle(state: bytes) -> str:
    """Why ``state`` is not a plain rendezvous state ('' if it is): it is read once with the
    restricted unpickler, so torch's own ``pickle.loads`` of the same bytes finds only the
    classes the check allowed and runs nothing else."""
    try:
        if not _OnlyRendezvousState.BUILD_TYPES:
            _OnlyRendezvousState.BUILD_TYPES = _state_types()
        _OnlyRendezvousState(io.BytesIO(state)).load()
    except Exception as exc:  # whatever the bytes make the unpickler raise
        return f"{type(exc).__name__}: {exc}"[:200]
    return ""


class SignedBackend:
    """torch's ``RendezvousBackend`` interface around torch's c10d backend: seals what is
    written, checks what is read (module docstring)."""

    def __init__(
        self,
        inner: Any,
        secret: bytes | None,
        key: str,
        endpoint: str,
        store: Any = None,
        nodes: int = 1,
    ) -> None:
        self._inner, self._secret, self._key, self._endpoint = inner, secret, key, endpoint
        self._store, self._nodes = store, nodes
        self._own: ForgedRendezvousState | None = None  # what this node refused, if it did
        self._refused = f"{key}.refused"
        """Set by a node that refused the state (another token's seal, or a forgery): the other
        nodes (the store's host, say) stop too, instead of waiting for nodes that never join."""
        self._known = f"{key}.refused.known"  # how many nodes have learnt of the refusal
        self._told = False

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Any] | None:
        self._check_refused()
        got = self._call(self._inner.get_state)
        return None if got is None else (self._open(got[0]), got[1])

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        self._check_refused()
        got = self._call(self._inner.set_state, self._seal(state), token)
        return None if got is None else (self._open(got[0]), got[1], got[2])

    def _check_refused(self) -> None:
        if self._own is not None:  # this node refused the state itself: say why, again
            raise self._own
        if self._store is None or not self._store.check([self._refused]):
            return
        self._learnt()
        # Refused by another node: because the state there was signed with another token, or
        # because someone overwrote it (a forgery refuses everyone). Read it: if this node
        # refuses it too, that is the reason to give (raised by ``_open``).
        got = self._call(self._inner.get_state)
        if got is not None:
            self._open(got[0])
        raise ForgedRendezvousState(
            f"another node refused the rendezvous state under key {self._key!r} in the store at "
            f"{self._endpoint}: it was signed with a different --rdzv-token (RANKWISE_RDZV_TOKEN) "
            "than that node's, so the nodes can never meet; the job stops here",
            fix="give every node of the job the same --rdzv-token (or RANKWISE_RDZV_TOKEN), or "
            "none on any node; a job started before with another token needs another --rdzv-id.",
        )

    def _refuse(self, why: str) -> ForgedRendezvousState:
        """Stop this node, and tell the others (they read ``_refused``) before leaving."""
        self._own = self._forged(why)
        if self._store is not None:
            with contextlib.suppress(Exception):  # the store is gone: this node stops anyway
                self._store.set(self._refused, why)
                self._learnt()
                deadline = time.monotonic() + LINGER_S
                while int(self._store.add(self._known, 0)) < self._nodes:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
        return self._own

    def _learnt(self) -> None:
        """Count this node among those that know of the refusal (once)."""
        if not self._told:
            self._told = True
            with contextlib.suppress(Exception):
                self._store.add(self._known, 1)

    def _call(self, fn: Any, *args: Any) -> Any:
        from torch.distributed.elastic.rendezvous import RendezvousStateError

        try:
            return fn(*args)
        except RendezvousStateError as exc:  # not even base64
            raise self._refuse(f"is not a rendezvous state ({exc})") from None

    def _mac(self, state: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, self._key.encode() + b"\0" + state, hashlib.sha256).digest()

    def _seal(self, state: bytes) -> bytes:
        return state if self._secret is None else MAGIC + self._mac(state) + state

    def _open(self, sealed: bytes) -> bytes:
        state = sealed
        if self._secret is not None:
            if not sealed.startswith(MAGIC):
                raise self._refuse("is not signed with this job's rendezvous secret")
            tag, state = sealed[len(MAGIC) : len(MAGIC) + _TAG], sealed[len(MAGIC) + _TAG :]
            if not hmac.compare_digest(tag, self._mac(state)):
                raise self._refuse("has a signature that does not match this job's secret")
        elif sealed.startswith(MAGIC):  # signed by a node that has a token, this one has none
            raise self._refuse("is signed, but this node was given no --rdzv-token")
        why = check_pickle(state)
        if why:
            raise self._refuse(f"is not a plain rendezvous state ({why})")
        return state

    def _forged(self, why: str) -> ForgedRendezvousState:
        return ForgedRendezvousState(
            f"the rendezvous state under key {self._key!r} in the store at {self._endpoint} "
            f"{why}: it was not written by a node of this job, and was not unpickled; the job "
            "stops here",
            fix="give every node the same --rdzv-token (or RANKWISE_RDZV_TOKEN), use a distinct "
            "--rdzv-id per job, and keep the rendezvous port reachable only from the job's "
            "nodes (a firewall rule; docs/launcher.md).",
        )


def _create_handler(params: Any) -> Any:
    """torch's c10d store and backend, the backend wrapped, torch's dynamic handler."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    inner, store = create_backend(params)
    key = f"torch.rendezvous.{params.run_id}"  # the key torch's c10d backend keeps it under
    secret = _SECRETS.get(params.run_id)
    backend = SignedBackend(inner, secret, key, params.endpoint, store, params.min_nodes)
    return create_handler(store, backend, params)


def register(run_id: str, secret: bytes | None) -> None:
    """Make ``rankwise-c10d`` known to torch, with ``secret`` for rendezvous ``run_id``."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
    _SECRETS[run_id] = secret


def unregister(run_id: str) -> None:
    _SECRETS.pop(run_id, None)


def choose_secret(backend: str, max_nodes: int, token: str | None, new: bytes) -> bytes | None:
    """The rendezvous secret: the token's UTF-8 bytes when one is given (every node must have
    the same), ``new`` (random) when no other node can ever join, else None (unsigned: a
    warning, and the restricted unpickler alone stands between the store and the agent)."""
    if backend != "c10d":
        return None  # the static rendezvous keeps no pickled state
    if token:
        return token.encode()
    return new if max_nodes == 1 else None


def unsigned_warning(endpoint: str) -> str:
    """What a job without a secret is told: every such job, a loopback endpoint included,
    since torch's store listens on every address of its machine, not only the endpoint's (a
    store at 127.0.0.1 is reachable through the machine's other addresses)."""
    host = endpoint.rsplit(":", 1)[0]
    where = (
        f"its store listens on every address of this machine, not only on {host}, so the "
        "machine's other addresses reach it too: "
        if is_loopback(host)
        else ""
    )
    return (
        f"rankwise run: warning: the c10d rendezvous at {endpoint} is not signed: {where}anyone "
        "who can reach that port can forge the rendezvous state (rankwise refuses any state "
        "holding other objects, so no code runs, but forged members can disturb or stop the job)"
        "\nFix: give every node the same secret, e.g. export RANKWISE_RDZV_TOKEN=$(python -c "
        "'import secrets; print(secrets.token_hex(16))') on each node (or --rdzv-token), and "
        "keep the port reachable only from the job's nodes."
    )
