"""Tokenizer from GGUF metadata (equal to transformers' own conversion), chat template, and
incremental detokenization that never emits a broken character and honours stop strings."""
import pytest

from pdserve.common.tokenizer import IncrementalDetokenizer, load_tokenizer, render_chat


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def test_cached_tokenizer_equals_fresh_conversion(tmp_path, tok):
    fresh = load_tokenizer(None, cache_dir=tmp_path)  # converts from the GGUF
    again = load_tokenizer(None, cache_dir=tmp_path)  # reads the saved conversion
    text = "Hello, wörld! 日本語 ✓ <|im_start|>"
    assert fresh.encode(text) == again.encode(text) == tok.encode(text)
    assert render_chat(fresh, [{"role": "user", "content": "hi"}]) == render_chat(again, [{"role": "user", "content": "hi"}])


def test_saved_tokenizer_is_read_as_autotokenizer_would_without_torch(tmp_path, tok):
    """A folder naming the tokenizers-backed class is read with that class directly (the coordinator
    and gateway then start without importing torch) and equals what AutoTokenizer reads."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    tok.save_pretrained(str(tmp_path))
    direct, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    text, chat = "Hello, wörld! 日本語 ✓ <|im_start|>", [{"role": "user", "content": "hi"}]
    assert type(direct) is type(auto) and direct.encode(text) == auto.encode(text)
    assert render_chat(direct, chat) == render_chat(auto, chat) and direct.eos_token_id == auto.eos_token_id
    probe = f"import sys; from pdserve.common.tokenizer import load_tokenizer; load_tokenizer({str(tmp_path)!r}); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_chat_template_renders_im_start(tok):
    ids = render_chat(tok, [{"role": "user", "content": "What is 2+2?"}])
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?" in text


@pytest.mark.parametrize("text", ["plain ascii text, with spaces", "日本語のテキスト ✓ émoji 🙂🚀 done", "  leading spaces\nnew line"])
def test_incremental_equals_full_decode_and_never_breaks_characters(tok, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt_token_ids=[1, 2, 3])
    pieces = [d.step(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_truncates_and_is_never_streamed(tok):
    text = "The answer is 42. STOP here and more text"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop=["STOP", "never"])
    streamed = ""
    for i in ids:
        streamed += d.step(i)
        if d.stopped_by:
            break
    streamed += d.flush()
    assert d.stopped_by == "STOP"
    assert streamed == "The answer is 42. "
