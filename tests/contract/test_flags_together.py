"""``plan``'s workload options read together, as the user gives them: a contradiction among
``--context``, ``--max-model-len``, ``--max-seqs``, ``--batch`` and ``--kv-cache`` is refused
in one line naming the options as typed (``--batch 8`` from the command, ``batch=8`` from
:func:`selective_offload.plan`), or noted in one line where one option overrides another;
a keyword of the wrong type names the keyword, never an internal field."""

from __future__ import annotations

import pytest

import selective_offload
from selective_offload.cli import main
from selective_offload.errors import UserError
from selective_offload.plan_format import PlanInputs
from selective_offload.plan_format.inputs import InputError

BASE = ["plan", "qwen3.8-27b-fp8", "--device-memory", "24GiB", "--host-memory", "none"]
KEYWORDS = {"device_memory": "24GiB", "host_memory": "none"}


@pytest.mark.parametrize("flags,keywords,said,as_keywords", [
    (["--context", "100000", "--max-model-len", "4096", "--max-seqs", "2"],
     {"context": 100000, "max_model_len": 4096, "max_seqs": 2},
     "--context 100000 is beyond --max-model-len 4096", "context=100000 is beyond max_model_len=4096"),
    (["--batch", "8", "--max-model-len", "4096", "--max-seqs", "2"],
     {"batch": 8, "max_model_len": 4096, "max_seqs": 2},
     "--batch 8 is above --max-seqs 2", "batch=8 is above max_seqs=2"),
    (["--max-seqs", "4"], {"max_seqs": 4},
     "--max-seqs 4 sizes the KV cache only with --max-model-len", "max_seqs=4 sizes the KV cache only with "
                                                                   "max_model_len="),
    (["--max-model-len", "4096"], {"max_model_len": "4096"},
     "--max-model-len 4096 sizes the KV cache only with --max-seqs", "max_model_len=4096 sizes the KV cache only with "
                                                                     "max_seqs="),
])
def test_contradicting_workload_options_are_refused_naming_them_as_typed(capsys, flags, keywords, said, as_keywords):
    assert main([*BASE, *flags]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("selective-offload: error: ") and err.count("\n") == 1 and not out, err
    assert said in err
    with pytest.raises(UserError) as exc:
        selective_offload.plan("qwen3.8-27b-fp8", **KEYWORDS, **keywords)
    assert as_keywords in str(exc.value) and "--" not in str(exc.value), exc.value


def test_a_kv_cache_the_model_length_replaces_is_noted_in_one_line(capsys):
    argv = [*BASE, "--kv-cache", "3GiB", "--max-model-len", "4096", "--max-seqs", "2"]
    assert main(argv) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: --kv-cache")]
    assert notes == ["note: --kv-cache 3GiB is not used: --max-model-len with --max-seqs sizes the KV cache "
                     "(2 sequence(s) of 4096 tokens)"]
    plan = selective_offload.plan("qwen3.8-27b-fp8", **KEYWORDS, kv_cache="3GiB", max_model_len=4096, max_seqs=2)
    assert any(n.startswith("kv_cache=3GiB is not used: max_model_len= with max_seqs=") for n in plan.notes)
    assert main([*BASE, "--max-model-len", "4096", "--max-seqs", "2"]) == 0
    assert "is not used" not in capsys.readouterr().out


@pytest.mark.parametrize("keywords,said", [
    ({"batch": True}, "batch=: True is not a whole number"),
    ({"batch": 2.5}, "batch=: 2.5 is not a whole number"),
    ({"accept_rate": "x"}, "accept_rate=: 'x' is not a number"),
    ({"prefetch_step": 0}, "prefetch_step=: 0 must be 1 or more"),
    ({"kv_cache": "30GiB"}, "lower kv_cache= or reserve="),
])
def test_errors_from_python_name_the_keyword(keywords, said):
    with pytest.raises(UserError) as exc:
        selective_offload.plan("qwen3.8-27b-fp8", **KEYWORDS, **keywords)
    assert said in str(exc.value) and "--" not in str(exc.value), exc.value


def test_a_plan_made_in_python_that_contradicts_itself_is_refused():
    with pytest.raises(InputError, match="context tokens 200 is beyond max_model_len 100"):
        PlanInputs(device_memory_bytes=10**10, max_model_len=100, max_seqs=2, context_tokens=200).validate()
    with pytest.raises(InputError, match="batch 3 is above max_seqs 2"):
        PlanInputs(device_memory_bytes=10**10, max_model_len=100, max_seqs=2, batch=3).validate()
