"""Tool-call and reasoning parsers on plain strings (gateway/tool_parsers.py, gateway/reasoning.py,
gateway/tools.py's CallStream): each format's calls and content, whole and streamed in pieces of
every size, and the stream agrees with the whole extract (its slow twin)."""
import json

import pytest

from pdserve.gateway.reasoning import REASONING_PARSERS
from pdserve.gateway.tool_parsers import PARSERS
from pdserve.gateway.tools import CallStream, FunctionDef, Tool, ToolPlan, whole_calls

WEATHER = {"city": "Paris", "unit": "c"}
CASES = {  # parser -> [(output, content, [(name, arguments)])]
    "hermes": [
        ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
         "Let me check.", [("get_weather", WEATHER)]),
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1, "}"]}}</tool_call>',
         None, [("a", {}), ("b", {"x": [1, "}"]})]),
        ('<tool_call>{"name": "a", "arguments": {"q": 1}}', None, [("a", {"q": 1})]),  # unclosed at the end: still a call (vLLM)
        ('<tool_call>{"arguments": {"q": "x"}, "name": "late"}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>', None,
         [("late", {"q": "x"}), ("b", {})]),  # a call naming itself last is sent whole once complete
        ("No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None, [("get_weather", WEATHER)]),
        ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": "v"}}', None, [("a", {}), ("b", {"k": "v"})]),
        ("The answer is {x}.", "The answer is {x}.", []),
        ('{"nope": 1}', '{"nope": 1}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', None, [("get_weather", WEATHER)]),
        ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]b{"z": 0}', "Sure. ",
         [("get_weather", WEATHER), ("b", {"z": 0})]),
        ("plain [answer]", "plain [answer]", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="c")]', None, [("get_weather", WEATHER)]),
        ("[a(), b(n=1, flag=True, xs=[1, 2], d={'k': None})]", None, [("a", {}), ("b", {"n": 1, "flag": True, "xs": [1, 2], "d": {"k": None}})]),
        ("<|python_start|>[a(q='x')]<|python_end|>", None, [("a", {"q": "x"})]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ("[f(x)]", "[f(x)]", []),  # positional arguments are not a pythonic call
        ("Just text.", "Just text.", []),
    ],
}
ALL = [(p, *case) for p, cases in CASES.items() for case in cases]


def _named(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", ALL)
def test_extract(parser, text, content, calls):
    got_content, got = PARSERS[parser].extract(text)
    assert got_content == content and _named(got) == calls


def stream(plan: ToolPlan, text: str, size: int):
    """Feed text in pieces of `size` characters: (content, [(name, arguments)], ids, first deltas' shape ok)."""
    s = CallStream(plan)
    content, deltas = "", []
    for i in range(0, len(text), size):
        c, d = s.feed(text[i:i + size])
        content, deltas = content + c, deltas + d
    c, d = s.finish()
    content, deltas = content + c, deltas + d
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:  # a call opens with its index, id, type and name, no arguments yet
            assert d.index not in calls and d.type == "function" and d.function.name and d.function.arguments == ""
            calls[d.index] = [d.function.name, "", d.id]
        else:
            assert d.function.name is None
            calls[d.index][1] += d.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [(calls[i][0], json.loads(calls[i][1])) for i in sorted(calls)], [calls[i][2] for i in sorted(calls)]


@pytest.mark.parametrize("parser,text,content,calls", ALL)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_stream_equals_extract(parser, text, content, calls, size):
    plan = ToolPlan("auto", [], parser=PARSERS[parser], ids="mistral" if parser == "mistral" else "openai")
    got_content, got, ids = stream(plan, text, size)
    assert got_content == (content or "") and got == calls
    assert all(len(i) == 9 and i.isalnum() for i in ids) if parser == "mistral" else all(i.startswith("chatcmpl-tool-") for i in ids)
    whole_content, whole = whole_calls(plan, text)
    assert whole_content == content and [(c.function.name, json.loads(c.function.arguments)) for c in whole] == calls


def test_content_streams_before_the_call_section_and_holds_back_only_a_possible_tag():
    s = CallStream(ToolPlan("auto", [], parser=PARSERS["hermes"]))
    assert s.feed("Hello <tool") == ("Hello ", [])  # "<tool" may open <tool_call>: held back
    assert s.feed("s are fun") == ("<tools are fun", [])
    c, d = s.feed('<tool_call>{"name": "f", "arguments": {"a": ')
    assert c == "" and d[0].function.name == "f" and d[0].id and d[1].function.arguments == '{"a": '  # name first, then arguments
    _, d = s.feed('[1, "}"]')
    assert [x.function.arguments for x in d] == ['[1, "}"]']  # as they come, not at the end
    _, d = s.feed('}}\n</tool_call> trailing')
    assert [x.function.arguments for x in d] == ["}"]  # the call object's own brace is not an argument
    assert s.finish() == ("", [])
    s = CallStream(ToolPlan("auto", [], parser=PARSERS["pythonic"]))
    assert s.feed("  ") == ("", []) and s.feed("Hi") == ("  Hi", [])  # pythonic calls only open the output


def test_forced_calls_stream():
    tools = [Tool(function=FunctionDef(name="f")), Tool(function=FunctionDef(name="g"))]
    named = CallStream(ToolPlan("named", tools, name="g"))
    first = named.feed('{"a"')
    assert first[0] == "" and first[1][0].function.name == "g" and first[1][0].id and first[1][1].function.arguments == '{"a"'
    assert named.feed(": 1}")[1][0].function.arguments == ": 1}"  # argument fragments as they come
    text = '[{"name": "f", "parameters": {"s": "]}\\""}}, {"parameters": {"k": 2}, "name": "g"}]'  # g: arguments first
    for size in (1, 2, 7, 1000):
        content, calls, _ = stream(ToolPlan("required", tools), text, size)
        assert content == "" and calls == [("f", {"s": ']}"'}), ("g", {"k": 2})]
    whole_content, whole = whole_calls(ToolPlan("required", tools), text)
    assert whole_content is None and [c.function.name for c in whole] == ["f", "g"]


REASONING = [  # (output, reasoning, content)
    ("<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("Hmm, 2+2.</think>\n\n4", "Hmm, 2+2.", "\n\n4"),  # <think> was in the prompt
    ("still thinking when cut <thi", "still thinking when cut <thi", None),  # no </think>: all reasoning
    ("<think></think>Only content", None, "Only content"),
    ("<think>a < b </thin k> c</think>", "a < b </thin k> c", None),
]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text,reasoning,content", REASONING)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_reasoning_split_whole_and_streamed(name, text, reasoning, content, size):
    p = REASONING_PARSERS[name]
    assert p.split(text) == (reasoning, content)
    s = p.stream()
    r, c = "", ""
    for i in range(0, len(text), size):
        dr, dc = s.feed(text[i:i + size])
        r, c = r + dr, c + dc
    dr, dc = s.flush()
    assert (r + dr or None, c + dc or None) == (reasoning, content)


def test_forced_grammars_follow_vllm():
    """named: the function's parameters; required: a list of {name, parameters} objects, at most
    one without parallel_tool_calls, each tool's $defs shared at the top (a conflict is a 400)."""
    from pdserve.gateway.errors import ApiError
    from pdserve.gateway.tools import forced_spec

    ref = {"$defs": {"P": {"type": "integer"}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}
    tools = [Tool(function=FunctionDef(name="f", parameters=ref)), Tool(function=FunctionDef(name="g"))]
    assert json.loads(forced_spec(ToolPlan("named", tools, name="f")).spec) == ref
    schema = json.loads(forced_spec(ToolPlan("required", tools, parallel=False)).spec)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1 and schema["$defs"] == ref["$defs"]
    f, g = schema["items"]["anyOf"]
    assert f["properties"]["name"] == {"type": "string", "enum": ["f"]} and "$defs" not in f["properties"]["parameters"]
    assert g["properties"]["parameters"] == {"type": "object", "properties": {}} and g["required"] == ["name", "parameters"]
    assert "maxItems" not in json.loads(forced_spec(ToolPlan("required", tools)).spec)
    clash = {"$defs": {"P": {"type": "string"}}, "type": "object"}
    with pytest.raises(ApiError) as e:
        forced_spec(ToolPlan("required", tools + [Tool(function=FunctionDef(name="h", parameters=clash))]))
    assert e.value.status == 400 and "conflicting $defs 'P'" in e.value.message
    assert forced_spec(ToolPlan("auto", tools)) is None and forced_spec(ToolPlan("none", tools)) is None


def test_chat_formatter_splits_reasoning_then_finds_calls_streamed_and_whole():
    """The formatter (gateway/format.py) joins both: reasoning deltas first, then the calls found in
    the content after </think>, the last chunk ending "tool_calls"; the whole answer says the same."""
    from pdserve.gateway.format import ChatFormatter
    from pdserve.gateway.reasoning import REASONING_PARSERS
    from pdserve_client.library import Result, StreamDelta

    text = 'Need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    plan = ToolPlan("auto", [], parser=PARSERS["hermes"])
    fmt = ChatFormatter("id", 0, "m", None, plan, REASONING_PARSERS["deepseek_r1"])
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    chunks = [c for i, p in enumerate(pieces)
              for c in fmt.chunks(0, StreamDelta(p, [], finish_reason="stop" if i == len(pieces) - 1 else None))]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert reasoning == "Need the weather." and "".join(d.content or "" for d in deltas).strip() == ""
    assert calls[0].function.name == "get_weather" and json.loads("".join(t.function.arguments for t in calls)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    message, reason = fmt.message(Result("r", text=text, finish_reason="stop"))
    assert reason == "tool_calls" and message.reasoning_content == "Need the weather." and message.content == "\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_flags_are_checked_before_anything_starts():
    """vLLM's flags: --enable-auto-tool-choice needs --tool-call-parser; an unknown parser or an
    unreadable --chat-template is a usage error (pdserve gateway and pdserve launch)."""
    from click.testing import CliRunner

    from pdserve.cli import main

    for role in ("gateway", "launch"):
        r = CliRunner().invoke(main, [role, "--enable-auto-tool-choice"])
        assert r.exit_code == 2 and "--enable-auto-tool-choice requires --tool-call-parser" in r.output, r.output
        r = CliRunner().invoke(main, [role, "--tool-call-parser", "nope"])
        assert r.exit_code == 2 and "hermes" in r.output
        r = CliRunner().invoke(main, [role, "--chat-template", "/no/such/template.jinja"])
        assert r.exit_code == 2 and "cannot read" in r.output, r.output


class CountedText(str):
    """A str whose `find` counts the characters it is asked to search (from its start argument)."""

    searched = 0

    def find(self, sub, start=0, *rest):
        CountedText.searched += len(self) - start
        return str.find(self, sub, start, *rest)

    def __add__(self, other):
        return CountedText(str.__add__(self, other))

    def __getitem__(self, key):
        return CountedText(str.__getitem__(self, key))


@pytest.mark.parametrize("calls", [0, 200])
def test_a_stream_searches_each_character_a_bounded_number_of_times(calls):
    """Content then many hermes calls, fed 3 characters a delta: the stream's searches (every
    str.find on its text, counted) add up to a few times the text, not once per delta (which made a
    long answer quadratic on the gateway's loop), and what it streams equals the whole parse."""
    text = "x" * 30_000 + "".join(f'<tool_call>{{"name": "f", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(calls))
    s = CallStream(ToolPlan("auto", [], parser=PARSERS["hermes"]), text=CountedText())
    CountedText.searched = 0
    content, streamed = "", {}
    for i in range(0, len(text), 3):
        c, deltas = s.feed(text[i:i + 3])
        content += c
        for d in deltas:
            streamed[d.index] = streamed.get(d.index, "") + (d.function.arguments or "")
    searched = CountedText.searched
    c, deltas = s.finish()
    content += c
    for d in deltas:
        streamed[d.index] = streamed.get(d.index, "") + (d.function.arguments or "")
    whole_content, whole = whole_calls(ToolPlan("auto", [], parser=PARSERS["hermes"]), text)
    assert content == (whole_content or "") and [streamed[k] for k in sorted(streamed)] == [c.function.arguments for c in whole]
    # each delta re-searches at most a marker's length behind it: ~4x here; once per delta from the start was ~5,000x
    assert isinstance(s.text, CountedText) and searched <= 10 * len(text), f"{searched} characters searched for {len(text)}"


def test_the_mistral_pattern_does_not_backtrack_over_whitespace():
    """`name` and a long run of whitespace with no arguments: refused in linear time (the old
    pattern tried every split of the run between its two \\s*, ~n^2/2 steps)."""
    import time

    part = "f" + " " * 20_000 + "x"
    t0 = time.perf_counter()
    assert PARSERS["mistral"]._named(part) is None
    assert time.perf_counter() - t0 < 5.0  # the old pattern: ~2e8 steps here; this one: ~4e4
