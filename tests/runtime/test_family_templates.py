"""Each family's published chat template (tests/family_templates.py) as the test checkpoints carry
it: the template renders the prompt its model card documents, its quirks hold (Gemma 2 refuses a
system turn with a typed error carrying the template's message, Gemma 3 folds it into the first
user turn, Qwen3's enable_thinking and its history's <think> blocks, Mixtral's roles), the
checkpoint's tokenizer_config.json carries it, and the coordinator renders it with a request's
chat_template_kwargs as HF transformers' apply_chat_template does, never sharing the work of
requests whose kwargs differ."""
import json

import pytest

from pdserve.common.tokenizer import ChatTemplateRefused, load_tokenizer, render_chat
from pdserve.coordinator.tokenizing import inputs_key, tokenize
from pdserve_client.errors import InvalidRequestError
from pdserve_client.library import build_request
from tests.family_templates import DOCUMENTED, FAMILY_TOKENS, TEMPLATES
from tests.helpers import family_tokenizer, save_family_tokenizer, save_tiny_served_model

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is 7 prime?"}]


@pytest.fixture(scope="module")
def toks():
    return {family: family_tokenizer(family) for family in TEMPLATES}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_each_template_renders_the_documented_prompt(toks, family):
    tok = toks[family]
    messages, documented = DOCUMENTED[family]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == documented
    ids = render_chat(tok, messages)
    assert ids == tok.encode(documented, add_special_tokens=False)
    spec = FAMILY_TOKENS[family]
    for t in spec["special"] + spec["plain"] + tuple(x for x in (spec["bos"], spec["eos"]) if x):
        if t in documented:  # a control token is one token of the prompt, as in the family's vocabulary
            assert tok.convert_tokens_to_ids(t) in ids, t


def test_gemma2_has_no_system_role(toks):
    tok = toks["gemma2"]
    with pytest.raises(ChatTemplateRefused, match="System role not supported") as e:
        render_chat(tok, CHAT)
    assert isinstance(e.value, InvalidRequestError) and e.value.code == "invalid_request"  # the caller's fault: a 400
    with pytest.raises(ChatTemplateRefused, match="Conversation roles must alternate"):
        render_chat(tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_gemma3_folds_the_system_prompt_into_the_first_user_turn(toks):
    text = toks["gemma3"].apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nIs 7 prime?<end_of_turn>\n<start_of_turn>model\n"


def test_mixtral_takes_user_and_assistant_turns_only(toks):
    with pytest.raises(ChatTemplateRefused, match="Only user and assistant roles are supported"):
        render_chat(toks["mixtral"], [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])


def test_qwen3_thinking_switch_and_history(toks):
    tok = toks["qwen3"]
    on = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    off = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and off == on + "<think>\n\n</think>\n\n"
    history = CHAT + [{"role": "assistant", "content": "<think>\n7 has no divisors.\n</think>\n\nYes."},
                      {"role": "user", "content": "And 9?"}]
    text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant\nYes.<|im_end|>" in text and "divisors" not in text  # an earlier turn's reasoning is dropped
    tools = [{"type": "function", "function": {"name": "is_prime", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(CHAT, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and '"name": "is_prime"' in text


def test_the_checkpoint_carries_its_template_in_tokenizer_config(tmp_path):
    from transformers import AutoTokenizer

    save_tiny_served_model(tmp_path, arch="gemma2", head_dim=16, max_position_embeddings=64)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == TEMPLATES["gemma2"][0] and not (tmp_path / "chat_template.jinja").exists()
    ours, hf = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.chat_template == hf.chat_template == TEMPLATES["gemma2"][0]
    model = json.loads((tmp_path / "config.json").read_text())
    assert model["vocab_size"] == len(ours) and (model["bos_token_id"], model["eos_token_id"]) == (ours.bos_token_id, ours.eos_token_id)
    assert ours.bos_token == "<bos>" and ours.eos_token == "<eos>"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(pdserve's, HF AutoTokenizer's) tokenizer of a directory holding Qwen3's tokenizer and template."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("qwen3")
    save_family_tokenizer(d, "qwen3")
    return load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"enable_thinking": True}])
def test_the_coordinator_renders_with_the_requests_template_kwargs(qwen3, kwargs):
    ours, hf = qwen3
    req = build_request(None, CHAT, None, {}, chat_template_kwargs=kwargs)
    want = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False, **(kwargs or {}))
    assert tokenize(ours, req) == list(want)


def test_requests_whose_template_kwargs_differ_never_share_a_rendering():
    plain = build_request(None, CHAT, None, {})
    off = build_request(None, CHAT, None, {}, chat_template_kwargs={"enable_thinking": False})
    on = build_request(None, CHAT, None, {}, chat_template_kwargs={"enable_thinking": True})
    assert len({inputs_key(plain), inputs_key(off), inputs_key(on)}) == 3
    assert inputs_key(off) == inputs_key(build_request(None, CHAT, None, {}, chat_template_kwargs={"enable_thinking": False}))
