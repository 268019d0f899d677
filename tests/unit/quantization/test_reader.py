"""quantization.reader.ConfigReader: the quantization_config reads every method's parser
makes, through jsonio.FieldReader. What configs in the wild write (aliases, null for unset,
integers as strings, one string for a list) reads; anything else is one CheckpointError
line naming the file, the method and the field's path, ending in the config way out."""

from __future__ import annotations

import pytest

from selective_offload.errors import CheckpointError
from selective_offload.quantization import scheme_from_config
from selective_offload.quantization.reader import ACTION, ConfigReader

WHERE = "model/config.json"


def refused(cfg) -> str:
    with pytest.raises(CheckpointError) as info:
        scheme_from_config(cfg, WHERE)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{WHERE}: quantization_config"), message
    assert message.endswith(f"; fix config.json or {ACTION}"), message
    return message


def test_the_first_key_set_is_read_and_null_is_unset():
    r = ConfigReader({"bits": None, "w_bit": 3, "lm_head": None, "ignore": "visual"}, "c: ", "awq")
    assert r.get_int("bits", "w_bit") == 3
    assert r.get_bool("lm_head", default=True) is True
    assert r.get_int("group_size", default=128) == 128
    assert r.names("ignore", "modules_to_not_convert") == ("visual",)


def test_integers_written_as_strings_read_as_integers():
    s = scheme_from_config({"quant_method": "gptq", "bits": "4", "group_size": "-1"}, WHERE)[0]
    assert (s.bits, s.group_size, s.strategy) == (4, None, "channel")


@pytest.mark.parametrize("cfg,words", [
    ({"quant_method": "gptq", "bits": "four"}, 'quantization_config (gptq): bits is "four", but must be an integer'),
    ({"quant_method": "awq", "bits": 4, "group_size": 0}, "group_size is 0, but must be an integer >= 1"),
    ({"quant_method": "gptq", "desc_act": "yes"}, 'desc_act is "yes", but must be true or false'),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size is [128, 0], but must be a list of 2"),
    ({"quant_method": "fp8", "ignored_layers": [1]}, "ignored_layers is [1], but must be a list of module names"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"],
                                                                    "weights": {"num_bits": "four"}}}},
     'config_groups.g.weights.num_bits is "four"'),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": 5}}},
     "config_groups.g.weights: must be an object, not a number"),
    ({"quant_method": "compressed-tensors", "config_groups": [1]}, "config_groups: must be an object, not a list"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0": {"quant_algo": "FP8", "group_size": True}}}},
     "quantization.quantized_layers.model.layers.0.group_size is true"),
])
def test_a_bad_value_names_its_path_and_what_it_must_be(cfg, words):
    message = refused(cfg)
    assert words in message, message
