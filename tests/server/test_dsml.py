"""DSML: render -> parse round trips, streaming at every split point, held-back markers, malformed input."""

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtier.server.text.dsml import DsmlStreamParser, parse_completion
from flashtier.server.text.dsml_events import (
    ContentDelta,
    ReasoningDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    collect_events,
    make_call_id,
)
from flashtier.server.text.dsml_markup import Invoke, parse_invoke_prefix, render_tool_calls

EOS = "<｜end▁of▁sentence｜>"

CALLS = [
    ("get_weather", {"city": "Paris", "days": 3}),
    ("search", {"query": 'rain "tomorrow"\nin 東京 🙂', "filters": {"lang": ["en", "ja"], "max": 2.5}, "exact": False}),
    ("noop", {}),
    ("write_file", {"path": "/tmp/a.txt", "content": "  line 1\n\tline 2\n\n", "mode": None}),
]

SAMPLE = (
    "The user wants the weather. I'll call a tool.</think>Let me check that for you.\n\n"
    + render_tool_calls(CALLS[:2])
    + EOS
)


def events_of(text: str, chunks: list[str], thinking: bool = True, tools: bool = True, cut: bool = False) -> list:
    parser = DsmlStreamParser(thinking, tools, id_seed="t")
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish(cut=cut)
    assert "".join(chunks) == text
    return events


def chunked(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def call_events(events: list) -> list:
    return [e for e in events if isinstance(e, (ToolCallStart, ToolCallArgsDelta, ToolCallEnd))]


# ---- rendering and round trips ------------------------------------------------------------------------------


def test_render_golden():
    assert render_tool_calls([("get_weather", {"city": "Paris", "days": [1, 2]})]) == (
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">[1, 2]</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>"
    )


@pytest.mark.parametrize("thinking", [False, True])
def test_round_trip_every_sample_call(thinking):
    text = ("r</think>" if thinking else "") + "content\n\n" + render_tool_calls(CALLS) + EOS
    parsed = parse_completion(text, thinking, True, id_seed="s")
    assert parsed.reasoning == ("r" if thinking else "")
    assert parsed.content == "content"
    assert [c.name for c in parsed.tool_calls] == [name for name, _ in CALLS]
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [args for _, args in CALLS]
    assert [c.id for c in parsed.tool_calls] == [make_call_id(i, "s") for i in range(len(CALLS))]


def test_sample_events_exactly():
    events = events_of(SAMPLE, [SAMPLE])
    assert events == [
        ReasoningDelta("The user wants the weather. I'll call a tool."),
        ContentDelta("Let me check that for you."),
        ToolCallStart(0, make_call_id(0, "t"), "get_weather"),
        ToolCallArgsDelta(0, '{"city": "Paris", "days": 3}'),
        ToolCallEnd(0),
        ToolCallStart(1, make_call_id(1, "t"), "search"),
        ToolCallArgsDelta(1, json.dumps(CALLS[1][1], ensure_ascii=False)),
        ToolCallEnd(1),
    ]
    assert ToolCall("x", "f", "{}").to_openai() == {
        "id": "x",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True)


@given(st.lists(st.tuples(names, st.dictionaries(names, json_values, max_size=4)), min_size=1, max_size=3))
@settings(max_examples=150, deadline=None)
def test_round_trip_random_calls(calls):
    # String values containing DSML tags cannot be rendered raw (chat_encoding escapes them first).
    rendered = render_tool_calls(calls)
    if rendered.count("</｜DSML｜ parameter>") != sum(len(a) for _, a in calls):
        return
    parsed = parse_completion("\n\n" + rendered, thinking=False, tools_enabled=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(n, a) for n, a in calls]
    assert parsed.content == ""


# ---- streaming --------------------------------------------------------------------------------------------


def test_every_two_chunk_split_matches_non_streaming():
    whole = parse_completion(SAMPLE, True, True, id_seed="t")
    reference_calls = call_events(events_of(SAMPLE, [SAMPLE]))
    for cut in range(len(SAMPLE) + 1):
        events = events_of(SAMPLE, chunked(SAMPLE, [cut]))
        assert collect_events(events) == whole, cut
        assert call_events(events) == reference_calls


def test_character_by_character():
    events = events_of(SAMPLE, list(SAMPLE))
    assert collect_events(events) == parse_completion(SAMPLE, True, True, id_seed="t")


VARIANTS = [
    SAMPLE,
    "no think end, reasoning only </thin",
    "r</think>plain answer with \n\n paragraphs \n\n and a trailing blank line\n\n" + EOS,
    "r</think>\n\n" + render_tool_calls([("f", {})]) + "\n\ntrailing text" + EOS,
    "r</think>a" + '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ param',  # truncated
    "r</think>b\n\n<｜DSML｜ calls>\n<｜DSML｜ bogus>\n</｜DSML｜ calls>" + EOS + "ignored",
]


@pytest.mark.parametrize("text", VARIANTS)
@given(rng=st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_random_chunkings_match_non_streaming(text, rng):
    cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 12))]
    events = events_of(text, chunked(text, cuts))
    assert collect_events(events) == parse_completion(text, True, True, id_seed="t")
    texts = [e for e in events if isinstance(e, (ReasoningDelta, ContentDelta))]
    assert all(e.text for e in texts)


def test_partial_markers_are_held_back():
    parser = DsmlStreamParser(thinking=True, tools_enabled=True, id_seed="p")
    assert parser.feed("thinking hard </thi") == [ReasoningDelta("thinking hard ")]
    assert parser.feed("nk>Answer") == [ContentDelta("Answer")]
    assert parser.feed(".\n") == [ContentDelta(".")]
    assert parser.feed("\n<｜DSM") == []
    assert parser.feed("L｜ calls>\n") == []
    assert parser.feed('<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>') == [
        ToolCallStart(0, make_call_id(0, "p"), "f"),
        ToolCallArgsDelta(0, "{}"),
        ToolCallEnd(0),
    ]
    assert parser.feed("\n</｜DSML｜ calls><｜end▁of") == []
    assert parser.feed("▁sentence｜>junk") == []
    assert parser.finish() == []


def test_held_text_is_released_at_finish_when_no_marker_follows():
    parser = DsmlStreamParser(thinking=False, tools_enabled=True)
    assert parser.feed("ends with\n\n<｜DS") == [ContentDelta("ends with")]
    assert parser.finish() == [ContentDelta("\n\n<｜DS")]
    parser = DsmlStreamParser(thinking=True, tools_enabled=True)
    assert parser.feed("cut </th") == [ReasoningDelta("cut ")]
    assert parser.finish() == [ReasoningDelta("</th")]
    parser = DsmlStreamParser(thinking=False, tools_enabled=False)
    assert parser.feed("x<｜end▁") == [ContentDelta("x")]
    assert parser.finish() == [ContentDelta("<｜end▁")]


def test_random_ids_have_call_hex_shape():
    parser = DsmlStreamParser(thinking=False, tools_enabled=True)
    text = "\n\n" + render_tool_calls([("a", {}), ("b", {})])
    starts = [e for e in parser.feed(text) + parser.finish() if isinstance(e, ToolCallStart)]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", s.id) for s in starts)
    assert starts[0].id != starts[1].id


def test_feed_after_finish_is_an_error():
    parser = DsmlStreamParser(thinking=False, tools_enabled=False)
    parser.finish()
    with pytest.raises(ValueError):
        parser.feed("x")


# ---- modes and leniency -----------------------------------------------------------------------------------


def test_tools_disabled_leaves_dsml_as_content():
    text = "hi\n\n" + render_tool_calls([("f", {"a": 1})])
    parsed = parse_completion(text, thinking=False, tools_enabled=False)
    assert parsed.content == text and not parsed.tool_calls


def test_thinking_off_treats_think_tags_as_content():
    assert parse_completion("a</think>b", thinking=False, tools_enabled=True).content == "a</think>b"


def test_text_after_eos_is_ignored():
    parsed = parse_completion("r</think>answer" + EOS + "garbage", thinking=True, tools_enabled=True)
    assert (parsed.reasoning, parsed.content) == ("r", "answer")


def test_after_calls_whitespace_dropped_text_kept():
    block = "\n\n" + render_tool_calls([("f", {})])
    assert parse_completion(block + "\n \n", False, True).content == ""
    parsed = parse_completion("pre" + block + "\npost", False, True)
    assert parsed.content == "pre\npost" and len(parsed.tool_calls) == 1


def test_missing_calls_close_is_accepted_when_invokes_closed():
    text = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\n'
    parsed = parse_completion(text, False, True)
    assert [c.name for c in parsed.tool_calls] == ["f"] and parsed.content == ""


def test_block_without_separator_and_extra_newlines():
    assert parse_completion("x" + render_tool_calls([("f", {})]), False, True).content == "x"
    assert parse_completion("x\n\n\n" + render_tool_calls([("f", {})]), False, True).content == "x\n"


def test_string_false_value_that_is_not_json_is_kept_as_string():
    text = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="a" string="false">True</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="b" string="false">NaN</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="c">{"k": 1}</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
    (call,) = parse_completion(text, False, True).tool_calls
    assert json.loads(call.arguments) == {"a": "True", "b": "NaN", "c": {"k": 1}}


def test_json_body_invoke_is_accepted():
    text = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n{"x": [1, 2], "y": "z"}\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    )
    (call,) = parse_completion(text, False, True).tool_calls
    assert json.loads(call.arguments) == {"x": [1, 2], "y": "z"}


# ---- malformed input falls back to content ----------------------------------------------------------------

MALFORMED = [
    # garbage where an invoke should be
    "\n\n<｜DSML｜ calls>\nI changed my mind.",
    # unterminated invoke (the model ended its output inside it; max_tokens is a cut, below)
    '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">half',
    # duplicate parameter
    '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
    '<｜DSML｜ parameter name="a" string="true">1</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="a" string="true">2</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
    # invoke without a name
    "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
    # text between parameters
    '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\noops\n</｜DSML｜ invoke>\n</｜DSML｜ calls>',
]


@pytest.mark.parametrize("block", MALFORMED)
def test_malformed_block_becomes_raw_content(block):
    text = "Answer." + block
    parsed = parse_completion(text, thinking=False, tools_enabled=True, id_seed="t")
    assert parsed.content == text
    assert parsed.tool_calls == []
    for cut in range(len(text) + 1):
        assert collect_events(events_of(text, chunked(text, [cut]), thinking=False)) == parsed


def test_good_invoke_then_malformed_one():
    good = (
        '<｜DSML｜ invoke name="ok">\n<｜DSML｜ parameter name="a" string="false">1</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>"
    )
    bad_tail = '\n<｜DSML｜ invoke name="bad">\n<｜DSML｜ parameter name="a" string="true">x'
    text = "\n\n<｜DSML｜ calls>\n" + good + bad_tail
    parsed = parse_completion(text, thinking=False, tools_enabled=True, id_seed="t")
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("ok", '{"a": 1}')]
    assert parsed.content == bad_tail
    for cut in range(len(text) + 1):
        assert collect_events(events_of(text, chunked(text, [cut]), thinking=False)) == parsed


def test_after_malformed_markup_everything_is_content():
    text = "\n\n<｜DSML｜ calls>\nnope\n\n" + render_tool_calls([("f", {})])
    parsed = parse_completion(text, False, True)
    assert parsed.content == text and parsed.tool_calls == []


def test_random_chunking_of_random_text_never_raises():
    rng = random.Random(0)
    alphabet = [
        "<｜DSML｜ calls>",
        "<｜DSML｜ invoke",
        ' name="f">',
        "</｜DSML｜ invoke>",
        "</｜DSML｜ calls>",
        "<｜DSML｜ parameter",
        ' string="true">',
        "</｜DSML｜ parameter>",
        "\n",
        "x",
        "</think>",
        "{}",
        EOS,
    ]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 5))]
        for thinking in (False, True):
            events = events_of(text, chunked(text, cuts), thinking=thinking)
            assert collect_events(events) == parse_completion(text, thinking, True, id_seed="t")
            for call in collect_events(events).tool_calls:
                assert isinstance(json.loads(call.arguments), dict)


# ---- output cut off (max_tokens): no markup, a call with the arguments so far once its name is complete ----

JSON_BODY_INVOKE = '\n<｜DSML｜ invoke name="g">\n{"x": [1, 2], "y": "z \\"q\\""}\n</｜DSML｜ invoke>'
LEAD = "Let me check."
CUT_TEXT = LEAD + "\n\n" + render_tool_calls(CALLS).replace("\n</｜DSML｜ calls>", JSON_BODY_INVOKE + "\n</｜DSML｜ calls>")
NAMED_INVOKE = re.compile(r'<｜DSML｜ invoke name="[^"]+"')


def test_cut_at_every_character_shows_no_markup_and_the_calls_so_far():
    full = parse_completion(CUT_TEXT, False, True, id_seed="t").tool_calls
    assert [c.name for c in full] == ["get_weather", "search", "noop", "write_file", "g"]
    rng = random.Random(7)
    last: tuple[int, int] = (0, 0)
    for cut in range(len(CUT_TEXT) + 1):
        prefix = CUT_TEXT[:cut]
        parsed = parse_completion(prefix, False, True, id_seed="t", cut=True)
        # streamed in two pieces, the events fold to the same answer
        split = rng.randint(0, cut)
        assert collect_events(events_of(prefix, chunked(prefix, [split]), thinking=False, cut=True)) == parsed
        assert parsed.content == LEAD[:cut], cut  # "\n\n" and partial tags are never content
        assert len(parsed.tool_calls) == len(NAMED_INVOKE.findall(prefix)), cut
        for got, want in zip(parsed.tool_calls, full, strict=False):
            assert (got.id, got.name) == (want.id, want.name), cut
            assert "DSML" not in got.arguments and "<｜" not in got.arguments, cut
            if got.complete:
                assert got.arguments == want.arguments, cut
            else:
                assert want.arguments.startswith(got.arguments), cut
        assert all(c.complete for c in parsed.tool_calls[:-1]), cut
        progress = (len(parsed.tool_calls), len(parsed.tool_calls[-1].arguments) if parsed.tool_calls else 0)
        assert progress >= last, cut  # the arguments only grow as the cut moves on
        last = progress
    assert parse_completion(CUT_TEXT, False, True, id_seed="t", cut=True).tool_calls == full


def test_a_cut_call_has_no_end_event():
    text = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">ha'
    parser = DsmlStreamParser(thinking=False, tools_enabled=True, id_seed="p")
    assert parser.feed(text) == []
    assert parser.finish(cut=True) == [ToolCallStart(0, make_call_id(0, "p"), "f"), ToolCallArgsDelta(0, '{"a": "ha')]
    (call,) = collect_events([ToolCallStart(0, "call_x", "f"), ToolCallArgsDelta(0, '{"a": "ha')]).tool_calls
    assert call == ToolCall("call_x", "f", '{"a": "ha', complete=False)


def test_cut_drops_held_marker_starts_and_a_cut_calls_close():
    parser = DsmlStreamParser(thinking=False, tools_enabled=True)
    assert parser.feed("ends with\n\n<｜DS") == [ContentDelta("ends with")]
    assert parser.finish(cut=True) == []
    parser = DsmlStreamParser(thinking=True, tools_enabled=True)
    assert parser.feed("cut </th") == [ReasoningDelta("cut ")]
    assert parser.finish(cut=True) == []
    # after a complete call, a cut inside </｜DSML｜ calls> adds nothing (it used to leak as content)
    text = "\n\n" + render_tool_calls([("f", {})])
    for cut in range(text.index("</｜DSML｜ invoke>") + len("</｜DSML｜ invoke>"), len(text) + 1):
        parsed = parse_completion(text[:cut], False, True, cut=True)
        assert parsed.content == "" and [(c.name, c.arguments, c.complete) for c in parsed.tool_calls] == [
            ("f", "{}", True)], cut
    # without tools, DSML is text and a cut keeps it
    assert parse_completion("a\n\n<｜DSML｜ calls>", False, False, cut=True).content == "a\n\n<｜DSML｜ calls>"


@pytest.mark.parametrize(("text", "expected"), [
    ("<｜DSML｜ invoke", None),
    ('<｜DSML｜ invoke name="get_wea', None),
    ('<｜DSML｜ invoke name="f" nonsense>', None),
    ('<｜DSML｜ invoke name="f"', Invoke("f", "{")),
    ('<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" str', Invoke("f", "{")),
    ('<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">x "y"\n</｜DSML｜ par',
     Invoke("f", '{"a": "x \\"y\\"\\n')),
    ('<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="false">[1, ', Invoke("f", '{"a": [1,')),
    ('<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="false">1</｜DSML｜ parameter>\n',
     Invoke("f", '{"a": 1')),
    ('<｜DSML｜ invoke name="f">\n{"x": [1, 2]}\n</｜DSML｜ in', Invoke("f", '{"x": [1, 2]}')),
])
def test_parse_invoke_prefix(text, expected):
    assert parse_invoke_prefix(text) == expected
