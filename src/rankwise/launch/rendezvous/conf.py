"""``--rdzv-conf KEY=VALUE,...``: torchrun's extra settings for torch's c10d rendezvous.

torch reads these keys and ignores any other silently, so a misspelt key (``keepalive=1``)
would change nothing and say nothing: here an unknown key is refused, naming the keys torch
reads. The ones that matter for an elastic job (docs/elastic.md):

- ``keep_alive_interval`` / ``keep_alive_max_attempt`` (torch: 5 s, 3): a node whose agent has
  not written its heartbeat for interval x attempts is dropped from the rendezvous. Until then
  the survivors of a lost host cannot form a new round, so a killed host costs up to 15 s of
  waiting by default; 1 and 4 make it 4 s, at one store write per node per second. Less than
  4 s in all is refused (``_check_silence``: live nodes were dropped);
- ``last_call_timeout`` (torch: 30 s): how long a round that has its minimum of nodes waits
  for more (also ``RANKWISE_RDZV_LAST_CALL_S``);
- ``close_timeout``, ``heartbeat_timeout``, ``read_timeout``, ``is_host``, ``store_type``.

``join_timeout`` is ``--rdzv-timeout``'s, and is refused here so that one value holds it.
"""

from __future__ import annotations

import difflib

from ...errors import ConfigError

SECONDS = ("keep_alive_interval", "keep_alive_max_attempt", "last_call_timeout",
           "close_timeout", "heartbeat_timeout", "read_timeout")  # fmt: skip
"""Keys torch reads as a whole number (seconds, or attempts), each at least 1."""
WORDS = {"is_host": ("true", "false", "1", "0"), "store_type": ("tcp", "file")}
KNOWN = (*SECONDS, *WORDS)


def parse(text: str, backend: str) -> dict[str, str]:
    """``"a=1,b=2"`` as ``{"a": "1", "b": "2"}``, every key one torch's c10d rendezvous reads
    and every value of its kind; a ``ConfigError`` naming the item and the fix otherwise."""
    text = text.strip()
    if not text:
        return {}
    if backend == "static":
        raise ConfigError(
            f"--rdzv-conf {text!r} is given, but the static rendezvous reads none of it",
            fix="pass --rdzv-backend c10d --rdzv-endpoint HOST:PORT (an elastic job), "
            "or drop --rdzv-conf.",
        )
    out: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ConfigError(f"--rdzv-conf item {item!r} is not KEY=VALUE",
                              fix=f"write e.g. --rdzv-conf {RECOMMENDED}.")  # fmt: skip
        out[key] = _checked(key, value)
    _check_silence(out)
    return out


RECOMMENDED = "keep_alive_interval=1,keep_alive_max_attempt=4"
"""A lost node dropped after 4 s of silence (torch's default: 15 s); docs/elastic.md."""
LEAST_SILENCE_S = 4


def _check_silence(conf: dict[str, str]) -> None:
    """A live node must not be dropped: with interval 1 x 2 attempts, the test cluster's healthy
    agents were dropped while they trained, and a returning node then formed a job of its own
    beside them (two jobs, both "healthy"). torch's heartbeats come about one interval apart,
    and a node reads the state at most once a second, so under 4 s of allowed silence there is
    no margin left."""
    interval = int(conf.get("keep_alive_interval", 5))
    attempts = int(conf.get("keep_alive_max_attempt", 3))
    if interval * attempts < LEAST_SILENCE_S:
        raise ConfigError(
            f"--rdzv-conf keep_alive_interval={interval} x keep_alive_max_attempt={attempts} "
            f"drops a node after {interval * attempts} s without a heartbeat: a live but busy "
            "node can miss that, and a node joining then forms a second job beside the first",
            fix=f"allow at least {LEAST_SILENCE_S} s, e.g. --rdzv-conf {RECOMMENDED}.",
        )


def _checked(key: str, value: str) -> str:
    if key == "join_timeout":
        raise ConfigError(f"--rdzv-conf join_timeout={value} sets what --rdzv-timeout sets",
                          fix=f"pass --rdzv-timeout {value} instead.")  # fmt: skip
    if key not in KNOWN:
        near = difflib.get_close_matches(key, KNOWN, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(
            f"--rdzv-conf key {key!r} is not one torch's c10d rendezvous reads (it would be "
            "ignored without a word)",
            fix=f"{hint}the keys are: {', '.join(KNOWN)}.",
        )
    if key in SECONDS and not (value.isdigit() and int(value) >= 1):
        raise ConfigError(f"--rdzv-conf {key}={value!r} is not a whole number >= 1",
                          fix=f"write e.g. {key}=2.")  # fmt: skip
    if key in WORDS and value.lower() not in WORDS[key]:
        raise ConfigError(f"--rdzv-conf {key}={value!r} is not one of {', '.join(WORDS[key])}",
                          fix=f"write e.g. {key}={WORDS[key][0]}.")  # fmt: skip
    return value
