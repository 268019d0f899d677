"""The checkpoint reader: headers only, every dtype, shards with and without an index,
manifests, config-only estimates, and a clear error for each kind of corrupt input."""

from __future__ import annotations

import json
import pathlib
import threading

import pytest
import torch
from safetensors.torch import save_file

from helpers import save_tiny_idefics3, save_tiny_qwen3, write_header_only, write_raw_header
from selective_offload.checkpoint import (
    ModelFacts,
    load_checkpoint,
    manifest_from_config,
    read_manifest,
    read_shard_header,
    tensor_nbytes,
    write_manifest,
)
from selective_offload.errors import CheckpointError


def test_real_shard_sizes_match_torch(tmp_path):
    tensors = {
        "a.weight": torch.randn(7, 5, dtype=torch.bfloat16),
        "b.bias": torch.randn(3, dtype=torch.float32),
        "c.q": torch.zeros(4, 4, dtype=torch.int8),
        "d.f8": torch.zeros(6, 2, dtype=torch.float8_e4m3fn),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    ckpt = load_checkpoint(tmp_path)
    assert set(ckpt.tensors) == set(tensors)
    for name, t in tensors.items():
        info = ckpt.tensors[name]
        assert info.nbytes == t.numel() * t.element_size()
        assert info.shape == tuple(t.shape)
    assert ckpt.tensors["d.f8"].dtype == "F8_E4M3"
    assert ckpt.incomplete_shards == []


@pytest.mark.parametrize(
    "dtype,shape,expected",
    [("F8_E4M3", [4, 8], 32), ("F8_E5M2", [3], 3), ("U8", [10, 4], 40), ("BF16", [5], 10),
     ("F16", [2, 2], 8), ("F32", [3], 12), ("I8", [9], 9), ("I32", [2], 8), ("F4", [3], 2)],
)
def test_dtype_byte_sizes(dtype, shape, expected):
    assert tensor_nbytes(dtype, shape) == expected


def test_header_only_shard_plans_without_data(tmp_path):
    # 248320 x 5120 BF16 is 2.5 GB of declared data in a file of a few hundred bytes.
    shard = write_header_only(tmp_path / "model.safetensors",
                              {"lm_head.weight": ("BF16", [248320, 5120])})
    assert shard.stat().st_size < 1000
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.tensors["lm_head.weight"].nbytes == 248320 * 5120 * 2
    assert ckpt.incomplete_shards == [str(shard)]


def test_sharded_with_index(tmp_path):
    write_header_only(tmp_path / "model-00001-of-00002.safetensors", {"x.weight": ("BF16", [4, 4])})
    write_header_only(tmp_path / "model-00002-of-00002.safetensors", {"y.weight": ("F32", [4])})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "x.weight": "model-00001-of-00002.safetensors",
        "y.weight": "model-00002-of-00002.safetensors"}}))
    ckpt = load_checkpoint(tmp_path)
    assert {n: t.nbytes for n, t in ckpt.tensors.items()} == {"x.weight": 32, "y.weight": 16}


def test_sharded_without_index(tmp_path):
    for i in range(3):
        write_header_only(tmp_path / f"part{i}.safetensors", {f"t{i}": ("BF16", [8])})
    assert sorted(load_checkpoint(tmp_path).tensors) == ["t0", "t1", "t2"]


@pytest.mark.parametrize("shards,weight_map,match", [
    (["a"], {"x": "a.safetensors", "y": "b.safetensors"}, "b.safetensors"),  # the index names a missing shard
    (["a"], {"x": "a.safetensors", "z": "a.safetensors"}, "'z'"),  # the index disagrees with the headers
    (["a", "b"], None, "also in"),  # one tensor in two shards
], ids=["index-names-a-missing-shard", "index-disagrees-with-headers", "tensor-in-two-shards"])
def test_shards_that_disagree_are_an_error(tmp_path, shards, weight_map, match):
    for shard in shards:
        write_header_only(tmp_path / f"{shard}.safetensors", {"x": ("BF16", [2])})
    if weight_map:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("header,match", [
    (None, "too short"),  # a file shorter than its length prefix
    (b"{not json", "not valid JSON"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, "overlap"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, "need 16 bytes"),
    ({"a": {"dtype": "F12", "shape": [4], "data_offsets": [0, 12]}}, "unknown dtype 'F12'"),
], ids=["shorter-than-length-prefix", "not-json", "overlapping-offsets", "offsets-disagree-with-shape",
        "unknown-dtype"])
def test_a_bad_shard_header_is_an_error(tmp_path, header, match):
    path = tmp_path / "m.safetensors"
    if header is None:
        path.write_bytes(b"\x01\x02")
    else:
        write_raw_header(path, header)
    with pytest.raises(CheckpointError, match=match):
        read_shard_header(path)


def test_header_length_past_end_of_file(tmp_path):
    path = write_raw_header(tmp_path / "m.safetensors", {"x": {}}, declared_len=10_000)
    with pytest.raises(CheckpointError, match="runs past the end"):
        read_shard_header(path)


def test_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no \\*.safetensors shards"):
        load_checkpoint(tmp_path)


def test_facts_read_nested_text_config():
    facts = ModelFacts.from_config({
        "architectures": ["X"], "vision_config": {},
        "text_config": {"tie_word_embeddings": True, "num_hidden_layers": 8, "hidden_size": 32,
                        "vocab_size": 100, "mtp_num_hidden_layers": 1},
        "tie_word_embeddings": False,
    })
    assert facts.tie_word_embeddings is True
    assert (facts.num_hidden_layers, facts.hidden_size, facts.vocab_size) == (8, 32, 100)
    assert facts.has_vision and not facts.has_audio
    assert facts.num_mtp_layers == 1


@pytest.mark.parametrize("key", ["num_nextn_predict_layers", "mtp_num_hidden_layers"])
def test_facts_mtp_layer_count(key):
    assert ModelFacts.from_config({key: 2}).num_mtp_layers == 2


EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.mark.parametrize("config,names,tied,source", [
    ({}, None, False, "default"),                                  # nothing to go on: untied (most LLMs)
    ({}, [EMBED], True, "checkpoint"),                             # no lm_head stored: tied
    ({}, [EMBED, HEAD], False, "checkpoint"),
    ({"tie_word_embeddings": False}, [EMBED], True, "checkpoint"),  # says untied, stores no head
    ({"tie_word_embeddings": True}, [EMBED, HEAD], True, "config"),  # vLLM re-ties an identical head
    ({"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}}, [EMBED, HEAD], False,
     "text_config"),                                               # the language model's own flag first
])
def test_the_tie_flag_is_resolved_as_vllm_resolves_it(config, names, tied, source):
    facts = ModelFacts.from_config(config, names)
    assert (facts.tie_word_embeddings, facts.tie_source) == (tied, source)
    assert bool(facts.notes) == (config.get("tie_word_embeddings") is False and names == [EMBED])


@pytest.mark.parametrize("config_class,tied", [("VoxtralConfig", False), ("Gemma3Config", True),
                                              ("Llama4Config", False), ("Qwen2_5_VLConfig", False)])
def test_a_config_without_the_flag_takes_transformers_default_for_its_architecture(config_class, tied):
    """Voxtral and Llama 4 state no tie flag in their published configs; transformers
    resolves it per architecture (often False, sometimes only under text_config)."""
    import transformers

    resolved = getattr(transformers, config_class)()
    assert ModelFacts.from_config({}, None, resolved).tie_word_embeddings is tied


def test_manifest_round_trip(tmp_path):
    write_header_only(tmp_path / "m.safetensors", {"x.weight": ("F8_E4M3", [128, 64]),
                                                   "x.scale": ("F32", [1, 1])})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["A"], "tie_word_embeddings": False}))
    ckpt = load_checkpoint(tmp_path)
    write_manifest(ckpt, tmp_path / "manifest.json")
    again = read_manifest(tmp_path / "manifest.json")
    assert {n: t.nbytes for n, t in again.tensors.items()} == {n: t.nbytes for n, t in ckpt.tensors.items()}
    assert again.facts.tie_word_embeddings is False


def test_manifest_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "selective-offload/manifest-v1",
                               "tensors": {"x": {"dtype": "BF16"}}}))
    with pytest.raises(CheckpointError, match="needs a \"dtype\" and an integer \"shape\""):
        load_checkpoint(bad)
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(CheckpointError, match="neither a selective-offload manifest"):
        load_checkpoint(other)


@pytest.mark.parametrize("tie", [False, True])
def test_config_only_manifest_matches_the_saved_checkpoint(tmp_path, tie):
    save_tiny_qwen3(tmp_path, tie_word_embeddings=tie)
    real = load_checkpoint(tmp_path)
    estimated = manifest_from_config(tmp_path / "config.json")
    assert estimated.kind == "config"
    assert {n: t.nbytes for n, t in estimated.tensors.items()} == {
        n: t.nbytes for n, t in real.tensors.items()}


def _thread_rchar() -> int | None:
    """Bytes this thread passed through read()/pread() syscalls (Linux /proc accounting)."""
    try:
        text = open(f"/proc/self/task/{threading.get_native_id()}/io").read()
    except OSError:
        return None
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("rchar:")))


def test_reading_a_checkpoint_reads_only_its_headers(tmp_path, monkeypatch):
    """A shard with 64 MB of real tensor data: reading the checkpoint may read its 8-byte
    length, its JSON header and config.json, and nothing of the data. Counted twice: every
    byte returned through a file object opened by pathlib, and every byte this thread read
    through the read syscalls (which also sees builtins.open and os.read)."""
    save_file({f"w{i}": torch.zeros(4, 1 << 20) for i in range(4)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    data_bytes = 4 * 4 * (1 << 20) * 4
    header_len = int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    allowed = 8 + header_len + (tmp_path / "config.json").stat().st_size

    returned = []
    real_open = pathlib.Path.open

    class Counting:
        def __init__(self, f):
            self._f = f

        def read(self, *args):
            out = self._f.read(*args)
            returned.append(len(out))
            return out

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    monkeypatch.setattr(pathlib.Path, "open", lambda self, *a, **k: Counting(real_open(self, *a, **k)))
    before = _thread_rchar()
    ckpt = load_checkpoint(tmp_path)
    after = _thread_rchar()
    monkeypatch.undo()
    assert ckpt.total_bytes == data_bytes
    assert sum(returned) <= allowed
    if before is None:
        pytest.skip("no /proc/self/task/<tid>/io on this system: the syscall count was not taken "
                    "(the file-object count above passed)")
    assert after - before <= allowed + 4096, f"read {after - before} bytes of a {data_bytes}-byte checkpoint"


def test_config_only_manifest_of_a_vision_language_model(tmp_path):
    save_tiny_idefics3(tmp_path)
    real = load_checkpoint(tmp_path)
    estimated = manifest_from_config(tmp_path / "config.json")
    assert {n: t.nbytes for n, t in estimated.tensors.items()} == {
        n: t.nbytes for n, t in real.tensors.items()}
    assert any(n.startswith("model.vision_model.") for n in estimated.tensors)


def test_config_only_with_an_architecture_transformers_lacks(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"],
                                                      "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="does not know the architecture 'NoSuchModelForCausalLM'"):
        load_checkpoint(tmp_path / "config.json")
