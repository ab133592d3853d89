"""The frontend language without a model: chat templates, expressions, tracing, choice methods."""

from __future__ import annotations

import subprocess
import sys

import pytest

import sglang as sgl
from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.backend.native_backend import _dtype_to_regex
from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path
from sglang.lang.ir import REGEX_INT, SglExprList, SglSamplingParams
from sglang.lang.runner import extract_prefix_by_tracing


@pytest.mark.parametrize("path,name", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen"),
    ("qwen/qwen2.5-0.5b-instruct", "qwen"),
    ("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2-vl"),
    ("meta-llama/Llama-3.2-1B-Instruct", "llama-3-instruct"),
    ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "chatml"),
    ("some/base-model", "default"),
])
def test_template_by_model_path(path, name):
    assert get_chat_template_by_model_path(path).name == name


def test_templates_render_like_the_models():
    qwen = get_chat_template("qwen")
    messages = [{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]
    assert qwen.get_prompt(messages) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    llama3 = get_chat_template("llama-3-instruct")
    assert llama3.get_prompt([{"role": "user", "content": "Hi"}]) == (
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
    assert llama3.stop_str == ("<|eot_id|>",)


def test_smollm2_template_matches_the_tokenizer(smollm2_tokenizer):
    template = get_chat_template("smollm2")
    program_text = template.get_prompt([{"role": "system", "content": None}, {"role": "user", "content": "Hi"}])
    program_text += template.role_prefix_and_suffix["assistant"][0]
    hf = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                               add_generation_prompt=True)
    assert program_text == hf


def test_expressions_concatenate_both_ways():
    expr = "a" + sgl.gen("x") + "b"
    assert isinstance(expr, SglExprList) and len(expr.expr_list) == 3
    with pytest.raises(TypeError, match="Cannot concatenate"):
        sgl.gen("x") + 3
    select = sgl.gen("x", choices=["a", "b"])
    assert select.choices == ["a", "b"] and select.temperature == 0.0
    assert select.choices_method is sgl.token_length_normalized


def test_dtype_becomes_a_regex_with_stops():
    params = SglSamplingParams(stop="END", dtype="int")
    _dtype_to_regex(params)
    assert params.regex == REGEX_INT and params.stop == ["END", " ", "\n"]
    assert sgl.gen_int("n").dtype == "int" and sgl.gen_string("s").dtype == "str"


def test_tracing_stops_at_the_first_argument_or_generation():
    @sgl.function
    def prog(s, question):
        s += sgl.system("A long constant system prompt.")
        s += sgl.user("Fixed part. " + question)
        s += sgl.assistant(sgl.gen("answer"))

    prefix = extract_prefix_by_tracing(prog, BaseBackend())
    assert prefix == "SYSTEM:A long constant system prompt.\nUSER:Fixed part. "


def test_roles_and_state_without_a_model():
    @sgl.function
    def prog(s):
        s += sgl.system("sys")
        with s.user():
            s += "hello"
        s["note"] = "kept"
        s += sgl.assistant_begin()
        s += sgl.user_begin()

    state = prog.run(backend=BaseBackend())
    assert state["note"] == "kept" and "note" in state
    assert state.messages() == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
    assert isinstance(state.error(), AssertionError) and "Nested roles" in str(state.error())
    with pytest.raises(ValueError, match="Tried to append None"):
        state += None


def test_choice_methods_on_given_logprobs():
    choices = ["ab", "c"]
    # choice 0: tokens -1, -3 (mean -2); choice 1: one token -1.5
    inputs = [[[-1.0, 1, "a"], [-3.0, 2, "b"]], [[-1.5, 3, "c"]]]
    kwargs = dict(choices=choices, normalized_prompt_logprobs=[-2.0, -1.5], input_token_logprobs=inputs,
                  output_token_logprobs=[[], []])
    assert sgl.token_length_normalized(**kwargs).decision == "c"
    greedy = sgl.greedy_token_selection(**kwargs)
    assert greedy.decision == "ab"  # -1.0 beats -1.5 at the first token
    assert greedy.meta_info["greedy_logprob_matrix"] == [[-1.0, -3.0], [-1.5, -1.5]]
    unconditional = [[[None, 1, None], [-0.5, 2, None]], [[None, 3, None]]]
    out = sgl.unconditional_likelihood_normalized(**kwargs, unconditional_token_logprobs=unconditional)
    assert out.meta_info["normalized_unconditional_prompt_logprobs"] == [-1.75, -1.5]
    assert out.decision == "c"


def test_import_sglang_stays_light():
    code = "import sys, sglang; sglang.function; print('torch' in sys.modules, 'requests' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_endpoint_prefers_the_servers_template(monkeypatch):
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    replies = {"/get_model_info": {"model_path": "/models/my-finetune"},
               "/get_server_info": {"chat_template": "llama-3-instruct"}}
    monkeypatch.setattr(RuntimeEndpoint, "_get", lambda self, path: replies[path])
    assert RuntimeEndpoint("http://127.0.0.1:1").chat_template.name == "llama-3-instruct"
    replies["/get_server_info"] = {"chat_template": None}  # not reported: match by model path
    assert RuntimeEndpoint("http://127.0.0.1:1").chat_template.name == "default"
    assert RuntimeEndpoint("http://127.0.0.1:1", chat_template_name="qwen").chat_template.name == "qwen"


def test_var_scope_copy_and_concatenating_join():
    @sgl.function
    def prog(s):
        s += "Intro. "
        with s.var_scope("middle"):
            s += "inside"
        with s.copy() as c:
            c += " copied"
            c["seen"] = "yes"
        forks = s.fork(2)
        forks += lambda i: f" [branch {i}]"
        forks.join(mode="concate_and_append")

    state = prog.run(backend=BaseBackend())
    assert state["middle"] == "inside"
    assert state["seen"] == ["yes"]  # join gathers a copy's new variables as lists
    assert state.text() == "Intro. inside [branch 0] [branch 1]"
    with pytest.raises(ValueError, match="Invalid join mode"):
        state.fork(1).join(mode="bogus")
