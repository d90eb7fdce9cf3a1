"""``rw.load_pretrained`` / ``rw.save_pretrained`` in one process: the oracle is Hugging Face's
``from_pretrained`` (and the files safetensors itself reads); the checkpoints are written here
by ``save_pretrained`` of models built from a config (no download). The multi-process and mesh
cases are tests/dist/test_pretrained_dist.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import rankwise as rw
from rankwise.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import pretrained_cases as pc


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    pc.gpt2(0).save_pretrained(folder / "one")
    pc.gpt2(0).save_pretrained(folder / "sharded", max_shard_size=pc.SHARD)
    return folder


def _from_pretrained(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.parametrize("source", ["one", "sharded", "one/model.safetensors",
                                    "sharded/model.safetensors.index.json"])  # fmt: skip
def test_one_process_equals_from_pretrained_then_prepare(gpt2_dir, source):
    rt = rw.init(strategy="single")
    ref = rt.prepare(_from_pretrained(gpt2_dir / source.split("/")[0]))
    model = pc.gpt2(1)
    assert not _equal(model.state_dict(), ref.state_dict())
    model, _ = rt.prepare(model, torch.optim.AdamW(model.parameters()))
    info = rt.load_pretrained(model, gpt2_dir / source)
    assert _equal(model.state_dict(), ref.state_dict())
    assert info.loaded == 28 and info.read_bytes == info.total_bytes  # lm_head: tied, not read
    assert info.missing_keys == info.unexpected_keys == []


def test_base_model_files_and_task_model_files_cross(tmp_path):
    from transformers import GPT2Model, LlamaModel

    src = pc.gpt2(0)
    src.transformer.save_pretrained(tmp_path / "base")  # names without 'transformer.'
    task = pc.gpt2(1)
    rw.load_pretrained(task, tmp_path / "base")
    assert _equal(task.state_dict(), src.state_dict())
    src.save_pretrained(tmp_path / "task")
    base = GPT2Model(src.config)
    rw.load_pretrained(base, tmp_path / "task")  # 'transformer.' dropped
    assert _equal(base.state_dict(), src.transformer.state_dict())
    llama = pc.llama(0)
    LlamaModel.save_pretrained(llama.model, tmp_path / "llama-base")
    with pytest.raises(ConfigError, match=r"lm_head\.weight") as err:
        rw.load_pretrained(pc.llama(1), tmp_path / "llama-base")  # the head is not in a base
    assert "strict=False" in str(err.value) and "key_map" in str(err.value)
    partial = pc.llama(1)
    info = rw.load_pretrained(partial, tmp_path / "llama-base", strict=False)
    assert info.missing_keys == ["lm_head.weight"] and info.unexpected_keys == []
    assert torch.equal(partial.model.embed_tokens.weight, llama.model.embed_tokens.weight)


def test_half_precision_files_fill_fp32_parameters_and_back(tmp_path):
    src = pc.gpt2(0).to(torch.bfloat16)
    src.save_pretrained(tmp_path / "bf16")
    model = pc.gpt2(1)
    rw.load_pretrained(model, tmp_path / "bf16")
    assert model.transformer.wte.weight.dtype == torch.float32
    assert _equal(model.state_dict(), {k: v.float() for k, v in src.state_dict().items()})
    fp32 = pc.gpt2(0)
    fp32.save_pretrained(tmp_path / "fp32")
    half = pc.gpt2(1).half()
    rw.load_pretrained(half, tmp_path / "fp32")
    assert _equal(half.state_dict(), {k: v.half() for k, v in fp32.state_dict().items()})


def test_a_meta_device_model_is_materialized_by_the_load(gpt2_dir):
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(pc.gpt2(0).config)
    rw.load_pretrained(model, gpt2_dir / "sharded")
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert _equal(model.state_dict(), pc.gpt2(0).state_dict())


def test_a_compiled_model_and_key_map(tmp_path):
    src = pc.nano(0)
    state = {f"gpt.{k}": v.clone() for k, v in src.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "renamed.safetensors"))
    compiled = torch.compile(pc.nano(1))  # not run: the wrapper's _orig_mod is filled
    with pytest.raises(ConfigError, match=r"lacks 28 .*gpt\.blocks\.0"):
        rw.load_pretrained(compiled, tmp_path / "renamed.safetensors")
    rw.load_pretrained(compiled, tmp_path / "renamed.safetensors", key_map={r"^gpt\.": ""})
    assert _equal(compiled._orig_mod.state_dict(), src.state_dict())


def _rewrite(path: Path, change) -> Path:
    state = load_file(str(path / "model.safetensors"))
    out = path.parent / f"{path.name}-changed.safetensors"
    save_file(change(state), str(out), metadata={"format": "pt"})
    return out


def test_wrong_shapes_dtypes_and_extra_tensors_are_named(gpt2_dir):
    src = gpt2_dir / "one"
    wider = _rewrite(src, lambda s: {**s, "transformer.wpe.weight": torch.zeros(17, 32)})
    with pytest.raises(ConfigError, match=r"transformer\.wpe\.weight.*\[17, 32\].*\[16, 32\]"):
        rw.load_pretrained(pc.gpt2(1), wider)
    ints = _rewrite(src, lambda s: {**s, "transformer.ln_f.bias": torch.zeros(32, dtype=torch.int64)})
    with pytest.raises(ConfigError, match=r"transformer\.ln_f\.bias.*I64"):
        rw.load_pretrained(pc.gpt2(1), ints)
    extra = _rewrite(src, lambda s: {**s, "score.weight": torch.zeros(2, 32)})
    with pytest.raises(ConfigError, match=r"score\.weight"):
        rw.load_pretrained(pc.gpt2(1), extra)
    assert rw.load_pretrained(pc.gpt2(1), extra, strict=False).unexpected_keys == ["score.weight"]
    old = _rewrite(src, lambda s: {**s, "transformer.h.0.attn.bias": torch.ones(1, 1, 16, 16)})
    assert rw.load_pretrained(pc.gpt2(1), old).unexpected_keys == []  # HF's ignore list


def test_truncated_corrupt_and_pickle_files_are_refused_by_name(gpt2_dir, tmp_path):
    data = (gpt2_dir / "one" / "model.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.safetensors").write_bytes(len(data).to_bytes(8, "little") + b"{nope" * 9)
    for name in ("cut.safetensors", "junk.safetensors"):
        with pytest.raises(ConfigError, match=name.replace(".", r"\.") + ".*truncated or corrupt"):
            rw.load_pretrained(pc.gpt2(1), tmp_path / name)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin.*pickle"):
        rw.load_pretrained(pc.gpt2(1), tmp_path / "bin")
    with pytest.raises(ConfigError, match=r"not a \.safetensors file"):
        rw.load_pretrained(pc.gpt2(1), tmp_path / "bin" / "pytorch_model.bin")


def _index(folder: Path, weight_map) -> Path:
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def test_bad_indexes_are_refused_by_name(gpt2_dir, tmp_path):
    shard = gpt2_dir / "one" / "model.safetensors"
    escape = _index(tmp_path / "escape", {"transformer.wte.weight": f"../{shard.name}"})
    with pytest.raises(ConfigError, match=r"not a plain file name"):
        rw.load_pretrained(pc.gpt2(1), escape)
    gone = _index(tmp_path / "gone", {"transformer.wte.weight": "model-00001-of-00002.safetensors"})
    with pytest.raises(ConfigError, match=r"model-00001-of-00002\.safetensors"):
        rw.load_pretrained(pc.gpt2(1), gone)
    liar = _index(tmp_path / "liar", {"transformer.nothing": "model.safetensors"})
    (liar / "model.safetensors").write_bytes(shard.read_bytes())
    with pytest.raises(ConfigError, match=r"transformer\.nothing.*does not hold it"):
        rw.load_pretrained(pc.gpt2(1), liar)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(ConfigError, match="not a readable index"):
        rw.load_pretrained(pc.gpt2(1), tmp_path / "text")


def test_export_reads_back_with_from_pretrained(tmp_path):
    src = pc.gpt2(0)
    rw.save_pretrained(src, tmp_path / "one")
    assert _equal(_from_pretrained(tmp_path / "one").state_dict(), src.state_dict())
    assert json.loads((tmp_path / "one" / "config.json").read_text())["architectures"] == [
        "GPT2LMHeadModel"
    ]
    rw.save_pretrained(src, tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size="30KB")
    back = _from_pretrained(tmp_path / "bf16").state_dict()
    assert _equal(back, {k: v.bfloat16().float() for k, v in src.state_dict().items()})
    written = pc.file_state(tmp_path / "bf16")
    assert {v.dtype for v in written.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in written  # tied: stored once, as HF stores it


def test_export_over_an_old_one_keeps_other_files_and_drops_stale_shards(tmp_path):
    folder = tmp_path / "model"
    rw.save_pretrained(pc.gpt2(1), folder, max_shard_size=pc.SHARD)
    (folder / "tokenizer.json").write_text("{}")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    rw.save_pretrained(pc.gpt2(0), folder)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert _equal(_from_pretrained(folder).state_dict(), pc.gpt2(0).state_dict())
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary left


def test_export_refuses_what_safetensors_cannot_hold(tmp_path):
    model = torch.nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(ConfigError, match=r"weight.*complex64"):
        rw.save_pretrained(model, tmp_path / "c")
    with pytest.raises(ConfigError, match="max_shard_size"):
        rw.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "s", max_shard_size="big")
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="meta device"):
        rw.save_pretrained(meta, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
