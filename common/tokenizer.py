"""Tokenizer, chat template and incremental detokenization (no model weights needed).

Lifecycle: `load_tokenizer(path)` returns a transformers tokenizer, read from a HF directory or
converted from GGUF metadata by transformers. The GGUF conversion takes seconds, so its result
is saved once under a cache folder keyed by the file's path, size and mtime and read back from
there afterwards. A chat is rendered by `render_chat` (the model's template, with a request's
chat_template_kwargs); what the template raises on the messages (Gemma 2's "System role not
supported") is a `ChatTemplateRefused`, the caller's fault. Per request, an `IncrementalDetokenizer` turns each new token into the text it
adds, holding back bytes that do not yet form a whole UTF-8 character and text that may be the
start of a stop string, and reports the stop string that ends the request.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pdserve.common.errors import ModelLoadError
from pdserve.common.model_path import resolve_model_path
from pdserve.common.stop import StopStrings
from pdserve_client.errors import InvalidRequestError


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve" / "tokenizers"


# tokenizer_config.json classes that are transformers' tokenizers-library class itself
_TOKENIZERS_BACKEND = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def _from_dir(path: Path):
    """AutoTokenizer.from_pretrained(path), but a folder whose tokenizer_config.json names the
    tokenizers-backed class (what save_pretrained writes for the default model) is read with that
    class directly: the same class AutoTokenizer picks, without AutoTokenizer's import of torch
    (seconds of start-up for the coordinator and the gateway, which need no torch)."""
    try:
        tok_class = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        tok_class = None
    if tok_class in _TOKENIZERS_BACKEND:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_tokenizer(model=None, cache_dir: Path | None = None):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = resolve_model_path(model)
    try:
        if path.is_dir():
            return _from_dir(path)
        st = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cached = (cache_dir or _cache_root()) / key
        if (cached / "tokenizer_config.json").is_file():
            return _from_dir(cached)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        try:
            tok.save_pretrained(str(cached))
        except OSError:
            pass  # a read-only cache only costs the conversion next time
        return tok
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


def eos_token_ids(tokenizer, model_eos: tuple[int, ...] = ()) -> set[int]:
    ids = set(model_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class ChatTemplateRefused(InvalidRequestError):
    """The model's chat template raised on these messages: its own raise_exception (Gemma's
    "System role not supported", roles that do not alternate) or a Jinja error on their shape."""


def apply_template(tokenizer, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None, **options):
    """tokenizer.apply_chat_template(messages, tools=tools, **options, **template_kwargs): what the
    template raises (jinja2's TemplateError, raise_exception's included) becomes ChatTemplateRefused
    naming its message, the caller's fault (a 400), never an internal error."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, **options, **(template_kwargs or {}))
    except TemplateError as e:
        raise ChatTemplateRefused(f"the model's chat template refused these messages: {e}") from None


def render_chat(tokenizer, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` (and `tools`, OpenAI's list, which the template may show) under
    the model's chat template, ready for the assistant turn. template_kwargs: further variables
    the template reads (vLLM's chat_template_kwargs: Qwen3's enable_thinking), checked by the
    caller against wire/limits.py's allow-list."""
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError("each message needs 'role' and 'content'")
    if tokenizer.chat_template is None:
        raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
    ids = apply_template(tokenizer, messages, tools, template_kwargs, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def template_message(m) -> dict:
    """A chat message (pdserve_client.protocol.ChatMessage) as HF chat templates read it: its tool calls
    with their arguments as objects, as vLLM hands them to templates."""
    d = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template shows the text


def load_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a file's path, or (holding any of `{}` or a newline) the template itself."""
    if any(c in value for c in "{}\n"):
        return value
    try:
        return Path(value).read_text()
    except OSError as e:
        raise InvalidRequestError(f"--chat-template: cannot read {value}: {e}") from None


class IncrementalDetokenizer:
    """Text of a growing output, one token at a time (prefix/read offsets, as in TGI and vLLM)."""

    CONTEXT = 5  # prompt tokens decoded ahead of the output so leading spaces come out right

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | tuple = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip = skip_special_tokens
        self.stop = StopStrings(stop)
        self.holdback = max(self.stop.longest, 1) - 1
        self.text = ""  # the whole output text so far (truncated at a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.stopped_by: str | None = None

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        """Add one token; return the text now safe to show (may be "")."""
        if self.stopped_by is not None:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop(start)
        limit = len(self.text) if self.stopped_by is not None else len(self.text) - self.holdback
        return self._emit(limit)

    def _check_stop(self, start: int) -> None:
        hit = self.stop.first(self.text, start) if self.stop else None  # common/stop.py: cost independent of the list's length
        if hit is not None:
            i, s = hit
            self.text = self.text[:i]
            self.stopped_by = s

    def _emit(self, limit: int) -> str:
        if limit <= self.emitted:
            return ""
        out = self.text[self.emitted:limit]
        self.emitted = limit
        return out

    def flush(self) -> str:
        """The held-back tail, once the request has finished."""
        return self._emit(len(self.text))
