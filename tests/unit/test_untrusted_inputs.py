"""Files and pickles nobody vouches for (issue 42): a pretrained folder's index and shards, and
the restricted unpicklers (DCP's ``.metadata``, the rendezvous state).

- An index whose file names are not strings is a ``ConfigError`` naming the index and the
  value (it was a raw ``TypeError``).
- A FIFO named by an index, or standing as ``model.safetensors``, is refused at once (it hung
  in safetensors' native open, which no signal interrupts: the case runs in a child process
  with a timeout, so a hang fails the test instead of stopping the run).
- A link out of a pretrained folder is refused; the links of Hugging Face's cache (a
  snapshot's files to the repository's ``blobs``) are followed.
- A pickle that would ``BUILD`` (set attributes) on a class is refused by both restricted
  unpicklers, and the class is unchanged; their legitimate inputs still load.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import rankwise as rw
from rankwise.checkpoint.pretrained.source import Source
from rankwise.checkpoint.sharded import dcp_meta


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"weight": torch.randn(4, 3), "bias": torch.randn(4)}


def _model() -> torch.nn.Linear:
    return torch.nn.Linear(3, 4)


def _indexed(folder: Path, names: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    t = _tensors()
    save_file({"weight": t["weight"]}, folder / "a.safetensors")
    save_file({"bias": t["bias"]}, folder / "b.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": names}))
    return folder


def test_an_index_naming_files_by_list_is_a_config_error_naming_it(tmp_path):
    folder = _indexed(tmp_path / "m", {"weight": ["a.safetensors"], "bias": "b.safetensors"})
    with pytest.raises(rw.ConfigError) as refused:
        rw.load_pretrained(_model(), folder)
    text = str(refused.value)
    assert "model.safetensors.index.json" in text and "['a.safetensors']" in text, text
    assert "(list)" in text and "bare file name" in text, text


def test_an_index_of_plain_names_loads(tmp_path):
    folder = _indexed(tmp_path / "m", {"weight": "a.safetensors", "bias": "b.safetensors"})
    model = _model()
    rw.load_pretrained(model, folder)
    assert torch.equal(model.weight.detach(), _tensors()["weight"])


def test_an_index_past_its_cap_is_refused(tmp_path, monkeypatch):
    from rankwise.checkpoint.pretrained import source

    folder = _indexed(tmp_path / "m", {"weight": "a.safetensors", "bias": "b.safetensors"})
    size = (folder / "model.safetensors.index.json").stat().st_size
    assert source.MAX_INDEX_BYTES == 64 << 20  # the documented cap, lowered for the test
    monkeypatch.setattr(source, "MAX_INDEX_BYTES", size - 1)
    with pytest.raises(rw.ConfigError, match=rf"index.json' is {size} bytes or more; at most "
                                             rf"{size - 1}"):  # fmt: skip
        rw.load_pretrained(_model(), folder)


_CHILD = """
import sys, time
import rankwise as rw, torch
start = time.monotonic()
try:
    rw.load_pretrained(torch.nn.Linear(3, 4), sys.argv[1])
except rw.ConfigError as exc:
    print("REFUSED", round(time.monotonic() - start, 2), exc)
else:
    print("LOADED")
"""


@pytest.mark.parametrize("where", ["named by the index", "as model.safetensors"])
def test_a_fifo_in_a_pretrained_folder_is_refused_not_waited_on(tmp_path, where):
    if where == "named by the index":
        folder = _indexed(tmp_path / "m", {"weight": "a.safetensors", "bias": "b.safetensors"})
        (folder / "b.safetensors").unlink()
        os.mkfifo(folder / "b.safetensors")
    else:
        folder = tmp_path / "m"
        folder.mkdir()
        os.mkfifo(folder / "model.safetensors")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), str(folder)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    out = done.stdout + done.stderr
    assert "REFUSED" in out and "FIFO" in out and str(folder) in out, out[-2000:]


def test_a_link_out_of_a_pretrained_folder_is_refused(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    save_file(_tensors(), tmp_path / "elsewhere.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(rw.ConfigError, match=r"model\.safetensors' is a link to .*elsewhere"
                                             r"\.safetensors', outside"):  # fmt: skip
        rw.load_pretrained(_model(), folder)
    index = _indexed(tmp_path / "n", {"weight": "a.safetensors", "bias": "b.safetensors"})
    (index / "b.safetensors").unlink()
    (index / "b.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(rw.ConfigError, match=r"b\.safetensors' is a link to .*, outside"):
        rw.load_pretrained(_model(), index)


def test_the_links_of_hugging_faces_cache_are_followed(tmp_path):
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    save_file(_tensors(), repo / "blobs" / "3f2a")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/3f2a")
    model = _model()
    rw.load_pretrained(model, snapshot)
    assert torch.equal(model.bias.detach(), _tensors()["bias"])
    assert Source(snapshot).files == [snapshot / "model.safetensors"]


# -- restricted unpicklers: no BUILD on a class -----------------------------------------


def _build_on_class(module: str, name: str, attribute: str) -> bytes:
    """A pickle: GLOBAL module.name, then BUILD with a slot state setting ``attribute`` to a
    string (pickle's setattr path) on the class itself."""
    g = f"c{module}\n{name}\n".encode()
    key, value = attribute.encode(), b"pwned"
    state = b"N}" + b"X" + len(key).to_bytes(4, "little") + key
    state += b"X" + len(value).to_bytes(4, "little") + value + b"s\x86"
    return b"\x80\x02" + g + state + b"b."


def test_metadata_that_sets_attributes_on_a_class_is_refused_and_changes_nothing(tmp_path):
    (tmp_path / ".metadata").write_bytes(_build_on_class("pathlib", "PosixPath", "home"))
    assert "home" not in vars(pathlib.PosixPath)  # inherited from Path
    with pytest.raises(rw.ConfigError, match=r"BUILD on type .*PosixPath.*refused"):
        dcp_meta.read_metadata(tmp_path)
    assert "home" not in vars(pathlib.PosixPath)
    # the path this used to take: the C unpickler sets it (so the check is what refuses)
    try:
        pickle.loads(_build_on_class("pathlib", "PosixPath", "home"))
        assert vars(pathlib.PosixPath)["home"] == "pwned"
    finally:
        if "home" in vars(pathlib.PosixPath):
            del pathlib.PosixPath.home


def test_the_rendezvous_check_refuses_build_on_a_class_and_reads_a_real_state():
    import datetime

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from rankwise.launch.rendezvous.signed import check_pickle

    why = check_pickle(_build_on_class(dr.__name__, "_NodeDesc", "__repr__"))
    assert "BUILD on type" in why and "_NodeDesc" in why, why
    assert dr._NodeDesc.__repr__ is not None and "pwned" not in repr(dr._NodeDesc("h", 1, 0))
    state = dr._RendezvousState()
    node = dr._NodeDesc("host", 12, 0)
    state.participants[node] = 0
    state.last_heartbeats[node] = datetime.datetime.now(datetime.timezone.utc)
    state.deadline = datetime.datetime.now(datetime.timezone.utc)
    assert check_pickle(pickle.dumps(state)) == ""
