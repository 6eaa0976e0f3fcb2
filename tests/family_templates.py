"""Each served family's chat template as its model card publishes it, and the tokens its
tokenizer gives those templates, for the test checkpoints (none can be downloaded here).

The templates are reproduced from memory of the `chat_template` in each model's official
tokenizer_config.json on the Hugging Face Hub, as faithfully as known, not copied from a
download: Qwen/Qwen3-0.6B (also Qwen3-MoE's, e.g. Qwen/Qwen3-30B-A3B: the same text; thinking
on unless `enable_thinking` is false, which puts an empty `<think>\\n\\n</think>\\n\\n` block in
the prompt; an assistant turn's `<think>` block is dropped from history before the last user
query), google/gemma-2-2b-it (no system role: raise_exception('System role not supported')),
google/gemma-3-1b-it (a system message is folded into the first user turn), microsoft/
Phi-3-mini-4k-instruct (its later revision, with a system role), mistralai/Mixtral-8x7B-
Instruct-v0.1 (its later revision: an optional system message folded into the first [INST]) and
Qwen/Qwen2-57B-A14B-Instruct (Qwen2's ChatML with the default system prompt), which the Qwen2-MoE
checkpoints use. `DOCUMENTED` holds, per family, the prompt its model card documents for one
short conversation, written out by hand: tests/runtime/test_family_templates.py renders each
template against it, an independent check of the transcription.

Lifecycle: data only. tests/helpers.py `save_family_tokenizer` writes a family's tokenizer (the
default model's vocabulary plus `FAMILY_TOKENS`, the family's bos/eos) with its template in
tokenizer_config.json; `save_tiny_served_model(arch=...)` does it for the families below.
"""
from __future__ import annotations

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501 (the template's own lines)

GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

MIXTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# family -> (its template, the arches of runtime/config.py that use it)
TEMPLATES = {
    "qwen3": (QWEN3, ("qwen3", "qwen3_moe")),
    "gemma2": (GEMMA2, ("gemma2",)),
    "gemma3": (GEMMA3, ("gemma3",)),
    "phi3": (PHI3, ("phi3",)),
    "mixtral": (MIXTRAL, ("mixtral",)),
    "qwen2": (QWEN2, ("qwen2_moe",)),
}
FAMILY_OF_ARCH = {arch: family for family, (_, arches) in TEMPLATES.items() for arch in arches}

# family -> the tokens its tokenizer holds for the template: bos/eos (None: the default model's),
# control tokens (special: skipped when output is decoded) and plain added tokens (kept in the
# output text, as Qwen3's <think> is: its tokenizer marks them special=False)
FAMILY_TOKENS = {
    "qwen3": dict(bos=None, eos="<|im_end|>", special=(), plain=("<think>", "</think>", "<tool_call>", "</tool_call>",
                                                                   "<tool_response>", "</tool_response>")),
    "gemma2": dict(bos="<bos>", eos="<eos>", special=("<start_of_turn>", "<end_of_turn>"), plain=()),
    "gemma3": dict(bos="<bos>", eos="<eos>", special=("<start_of_turn>", "<end_of_turn>", "<start_of_image>"), plain=()),
    "phi3": dict(bos="<s>", eos="<|endoftext|>", special=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), plain=()),
    "mixtral": dict(bos="<s>", eos="</s>", special=(), plain=()),
    "qwen2": dict(bos=None, eos="<|im_end|>", special=(), plain=()),
}

# the conversation DOCUMENTED renders: a system turn where the family has one, a user turn, a
# model answer and a second user turn, ready for the assistant
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a prime."},
]
NO_SYSTEM = CONVERSATION[1:]

# family -> (the messages, the prompt its model card documents for them, ready for the answer)
DOCUMENTED = {
    "qwen3": (CONVERSATION, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n"
                            "<|im_start|>assistant\n"),
    "gemma2": (NO_SYSTEM, "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                          "<start_of_turn>user\nName a prime.<end_of_turn>\n<start_of_turn>model\n"),
    "gemma3": (CONVERSATION, "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                             "<start_of_turn>user\nName a prime.<end_of_turn>\n<start_of_turn>model\n"),
    "phi3": (CONVERSATION, "<|system|>\nBe brief.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\nHello.<|end|>\n"
                           "<|user|>\nName a prime.<|end|>\n<|assistant|>\n"),
    "mixtral": (CONVERSATION, "<s> [INST] Be brief.\n\nHi! [/INST] Hello.</s> [INST] Name a prime. [/INST]"),
    "qwen2": (NO_SYSTEM, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                         "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n"
                         "<|im_start|>assistant\n"),
}
