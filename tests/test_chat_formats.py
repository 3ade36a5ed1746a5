"""Chat formats: a Hugging Face checkpoint's own tokenizer and chat template (rendered exactly as transformers
renders it), the Hermes tool-call parser, the format registry, token-in/token-out across turns, the SFT
mask and the tool grammar over the checkpoint's markers. The checkpoint is a tiny one built locally
(`bench.tiny_hf`); transformers is the reference."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from codefleet.agent.clients.episode_tokens import EpisodeTokens
from codefleet.agent.tools import tool_schemas
from codefleet.bench.tiny_hf import CHAT_TEMPLATE, write_tokenizer
from codefleet.chat import tool_parser
from codefleet.chat.formats import CODEFLEET, TemplateFormat, check_vocab, for_checkpoint, of
from codefleet.chat.tokenizer import HFTokenizer, default_tokenizer
from codefleet.chat.tool_parser import PARSERS, choose
from codefleet.inference.grammar import ToolCallGrammar

TOOLS = tool_schemas()


def call(name: str, arguments: dict, id_: str = "c") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def conversations() -> list[tuple[list[dict], list[dict] | None]]:
    task = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix pkg/calc.py; the test says <|im_end|> and <tool_call>."},
    ]
    turn = {
        "role": "assistant",
        "content": "<think>\nRead it first.\n</think>\n\nReading both.",
        "tool_calls": [call("read_file", {"path": "pkg/calc.py"}, "a"), call("run", {"command": "pytest -q"}, "b")],
    }
    results = [
        {"role": "tool", "tool_call_id": "a", "content": "     1\tdef add(a, b):\n     2\t    return a - b"},
        {"role": "tool", "tool_call_id": "b", "content": "1 failed"},
    ]
    done = {"role": "assistant", "content": "Fixed.", "tool_calls": None}
    return [
        (task, TOOLS),
        (task[1:], None),
        (task + [turn] + results, TOOLS),
        (task + [turn] + results + [done], None),
        (task + [turn] + results + [done, {"role": "user", "content": "And the docs?"}], TOOLS),
        ([{"role": "user", "content": [{"type": "text", "text": "parts"}]}], []),
    ]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_hf_tok"))
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf(hf_dir):
    return for_checkpoint(hf_dir)


def test_render_is_transformers_apply_chat_template(hf_dir, hf):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dir)
    _, fmt = hf
    for messages, tools in conversations():
        for prompt in (True, False):
            expected = reference.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=prompt
            )
            assert fmt.render(messages, tools, prompt) == expected
    text = fmt.render(*conversations()[2])
    assert '<tools>\n{"type": "function", "function": {"name": "search"' in text
    assert '<tool_call>\n{"name": "run", "arguments": {"command": "pytest -q"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n     1\tdef add" in text and text.endswith("<|im_start|>assistant\n")


def test_named_templates_and_jinja_file(tmp_path, hf_dir):
    transformers = pytest.importorskip("transformers")
    named = str(tmp_path / "named")
    shutil.copytree(hf_dir, named)
    config = json.load(open(os.path.join(named, "tokenizer_config.json")))
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"},
        {"name": "tool_use", "template": CHAT_TEMPLATE},
    ]
    json.dump(config, open(os.path.join(named, "tokenizer_config.json"), "w"))
    _, fmt = for_checkpoint(named)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(named)
    messages = conversations()[0][0]
    for tools in (None, TOOLS):
        assert fmt.render(messages, tools) == reference.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
    assert fmt.tool_calls.name == "hermes"  # chosen from every template the checkpoint has
    jinja = str(tmp_path / "jinja")
    shutil.copytree(hf_dir, jinja)
    del config["chat_template"]
    json.dump(config, open(os.path.join(jinja, "tokenizer_config.json"), "w"))
    with open(os.path.join(jinja, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    tok, fmt = for_checkpoint(jinja)
    assert fmt.render(messages, TOOLS) == of(HFTokenizer.load(hf_dir)).render(messages, TOOLS)
    saved = str(tmp_path / "saved")
    tok.save(saved)  # the template travels with the tokenizer
    assert for_checkpoint(saved)[1].render(messages) == fmt.render(messages)


def test_missing_chat_template_names_the_file(tmp_path):
    write_tokenizer(str(tmp_path), chat_template=None)
    with pytest.raises(ValueError, match=r"tokenizer_config.json has no \"chat_template\".*chat_template.jinja"):
        for_checkpoint(str(tmp_path))


def test_special_tokens_only_where_the_template_writes_them(hf):
    tok, fmt = hf
    messages, tools = conversations()[3]
    ids = fmt.encode_chat(tok, messages, tools)
    end, call_open = tok.special_id("<|im_end|>"), tok.special_id("<tool_call>")
    assert ids.count(end) == 5  # system, user, assistant, the tool results' user turn, assistant
    assert ids.count(call_open) == 2  # the two calls; not the user's text
    assert "the test says <|im_end|> and <tool_call>." in tok.decode(ids)
    assert not set(tok.encode("<|im_end|> <tool_call> <think>")) & set(tok.special.values())
    assert tok.encode("<tool_call><|im_end|>", allow_special=True) == [call_open, end]
    assert fmt.stop_ids(tok) == [end, tok.special_id("<|endoftext|>")]
    assert tok.decode(tok.encode("héllo\n\tx", allow_special=True)) == "héllo\n\tx"


def test_hermes_parser():
    hermes = PARSERS["hermes"]
    text = (
        '<think>\nplan\n</think>\n\nReading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "run", "arguments": "{\\"command\\": \\"ls\\"}"}\n</tool_call>'
    )
    turn = hermes.parse(text, "call_3_")
    assert turn.errors == [] and turn.content == "<think>\nplan\n</think>\n\nReading."
    assert [(c["id"], c["name"], json.loads(c["arguments_json"])) for c in turn.tool_calls] == [
        ("call_3_0", "read_file", {"path": "a.py"}),
        ("call_3_1", "run", {"command": "ls"}),
    ]
    bad = hermes.parse(
        '<tool_call>\n{"name": "run", "arguments": {"command": "ls"</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "run", "arguments": [1]}'
        '</tool_call>stray</tool_call><tool_call>{"name": "submit", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "run"'
    )
    assert [c["name"] for c in bad.tool_calls] == ["submit"]
    assert len(bad.errors) == 5 and "not valid JSON" in bad.errors[0] and 'no "name"' in bad.errors[1]
    assert "must be a JSON object, got list" in bad.errors[2] and "without an opening" in bad.errors[3]
    assert "no closing </tool_call>" in bad.errors[4] and all("</tool_call>" in e for e in bad.errors)
    stopped = PARSERS["hermes"].with_stops(("<|im_end|>",)).parse("done<|im_end|><tool_call>{}</tool_call>")
    assert stopped == ("done", [], [])


def test_registry_chooses_from_the_checkpoint(tmp_path, hf):
    tok, fmt = hf
    assert fmt.tool_calls.name == "hermes" and choose("{{ '<|tool_call|>' }}").name == "codefleet"
    assert choose("no tools here").name == "hermes" and choose(CHAT_TEMPLATE, "codefleet").name == "codefleet"
    with pytest.raises(ValueError, match="no tool-call parser 'xml'; choose one of codefleet, hermes"):
        choose(CHAT_TEMPLATE, "xml")
    assert of(default_tokenizer()) is CODEFLEET and of(tok) is fmt
    codefleet_dir = str(tmp_path / "codefleet")
    default_tokenizer().save(codefleet_dir)
    assert for_checkpoint(codefleet_dir)[1] is CODEFLEET and for_checkpoint(str(tmp_path))[1] is CODEFLEET


def test_vocabulary_checks(hf_dir):
    tok = HFTokenizer.load(hf_dir)
    with pytest.raises(ValueError, match="has 4105 tokens but the model's embedding has 4100 rows"):
        check_vocab(tok, 4100)
    check_vocab(tok, 4160)
    assert tok.vocab_size == 4160 and tok.token_bytes(4150) == b"" and tok.decode([4150, 80]) == "a"
    with pytest.raises(ValueError, match="the tokenizer has 4096 tokens but the model's vocabulary is 4160"):
        check_vocab(default_tokenizer(), 4160)


def _sampled(tok, fmt, text: str, turn: int):
    """What an engine would return for a turn that wrote `text` and its end token, and the message the agent
    loop appends for it (tool calls parsed from the text)."""
    ids = tok.encode(text, allow_special=True) + [fmt.stop_ids(tok)[0]]
    parsed = fmt.parse_tool_calls(text, f"call_{turn}_")
    message = {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": tool_parser.openai_tool_calls(parsed.tool_calls) or None,
    }
    result = SimpleNamespace(
        token_ids=ids, logprobs=[-1.0] * len(ids), versions=[0] * len(ids), routed_experts=[], prompt_routed_experts=[]
    )
    return result, message


def _episode(tok, fmt, turns: list[tuple[str, list[dict]]], tools) -> tuple[EpisodeTokens, list[dict]]:
    """Run scripted turns (text written, messages that follow it) through EpisodeTokens."""
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix it."}]
    tokens = EpisodeTokens()
    for i, (text, after) in enumerate(turns):
        prompt = tokens.prompt(tok, messages, tools)
        result, message = _sampled(tok, fmt, text, i)
        tokens.add_turn(prompt, result, len(messages) + 1, fmt.stop_ids(tok)[0])
        messages += [message] + after
    return tokens, messages


def test_token_in_token_out_round_trips_an_agent_episode(hf):
    tok, fmt = hf
    turns = [
        (
            '<think>\nLook first.\n</think>\n\nReading.\n<tool_call>\n{"name": "read_file", "arguments": '
            '{"path": "a.py"}}\n</tool_call>\n<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n'
            "</tool_call>",
            [
                {"role": "tool", "tool_call_id": "call_0_0", "content": "x = 1 <|im_end|>"},
                {"role": "tool", "tool_call_id": "call_0_1", "content": "a.py"},
            ],
        ),
        (
            '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>',
            [{"role": "tool", "tool_call_id": "call_1_0", "content": "submitted"}],
        ),
        ("All done.", []),
    ]
    tokens, messages = _episode(tok, fmt, turns, TOOLS)
    # the whole conversation rendered by the template gives the ids the engine saw, turn by turn
    assert tokens.ids == fmt.encode_chat(tok, messages, TOOLS, add_generation_prompt=False)[: len(tokens.ids)]
    full = fmt.encode_chat(tok, messages, TOOLS, add_generation_prompt=False)
    assert full[len(tokens.ids) :] == tok.encode("\n")  # the newline the template writes after the last end token
    # the policy's tokens are exactly the sampled ones; the SFT mask of the same conversation marks the same
    ids, mask = fmt.encode_chat_with_mask(tok, messages, TOOLS)
    assert ids == full and mask[: len(tokens.mask)] == tokens.mask and not any(mask[len(tokens.mask) :])
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "".join(t + "<|im_end|>" for t, _ in turns)


def test_a_template_that_drops_earlier_reasoning_trains_on_what_the_engine_saw(hf):
    tok, fmt = hf
    thought = "<think>\nThe bug is in add.\n</think>\n\n"
    turns = [
        (thought + "It subtracts.", [{"role": "user", "content": "Then fix it."}]),
        ('<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>', []),
    ]
    tokens, messages = _episode(tok, fmt, turns, None)
    full = fmt.encode_chat(tok, messages, None, add_generation_prompt=False)
    # the template renders the first turn without its reasoning once a new user message follows ...
    assert "The bug is in add" not in tok.decode(full) and "It subtracts." in tok.decode(full)
    # ... while the episode keeps what the model wrote and conditioned on; only that span differs
    seen = tok.decode(tokens.ids)
    assert thought + "It subtracts.<|im_end|>" in seen
    assert seen.replace(thought, "", 1) + "\n" == tok.decode(full)
    assert tok.decode([t for t, m in zip(tokens.ids, tokens.mask) if m]).startswith(thought)


def test_tool_grammar_over_the_checkpoints_markers(hf):
    tok, fmt = hf
    check_vocab(tok, 4160)
    grammar = ToolCallGrammar.build(tok, TOOLS)
    assert (grammar.call_open, grammar.call_close) == (tok.special_id("<tool_call>"), tok.special_id("</tool_call>"))
    turn = (
        '<think>\nok\n</think>\n\nReading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
        "</tool_call>"
    )
    matcher = grammar.start()
    for token in tok.encode(turn, allow_special=True) + [tok.special_id("<|im_end|>")]:
        assert matcher.allows(token), tok.decode([token])
        matcher.advance(token)
    m = grammar.start()
    for token in tok.encode("See </tool_call"):  # text that spells a marker in bytes
        m.advance(token)
    assert not m.allows(tok.encode(">")[0]) and m.allows(tok.encode("x")[0])
    m = grammar.start()
    m.advance(tok.special_id("<tool_call>"))
    for token in tok.encode('{"name": "run", "arguments": {"command": "echo </tool_call'):
        assert m.allows(token)
        m.advance(token)
    assert not m.allows(tok.encode(">")[0])  # a string may not close the call early
    assert not grammar.start().allows(tok.special_id("<|im_start|>")) and not grammar.start().allows(4150)
    required = ToolCallGrammar.build(tok, TOOLS, "required", calls_only=True, max_calls=1).start()
    assert not required.allows(tok.encode("Hi")[0]) and required.allows(tok.special_id("<tool_call>"))
    assert not required.allows(tok.special_id("<|im_end|>"))
    none = ToolCallGrammar.build(tok, [], "none").start()
    assert not none.allows(tok.special_id("<tool_call>")) and none.allows(tok.special_id("<|im_end|>"))
    mask = grammar.start().allowed_mask()
    assert mask.shape == (4160,) and not mask[tok.special_id("</tool_call>")] and mask[tok.encode("a")[0]]
    assert torch.equal(mask, grammar.start().allowed_mask())


def test_template_format_pickles(hf):
    import pickle

    tok, fmt = hf
    again = pickle.loads(pickle.dumps(tok))
    assert isinstance(of(again), TemplateFormat) and of(again).render(conversations()[0][0]) == fmt.render(
        conversations()[0][0]
    )


@pytest.mark.parametrize(
    "payload",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ cycler.__init__.__globals__.os.system('touch CANARY') }}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_a_hostile_chat_template_cannot_reach_python(tmp_path, hf_dir, payload):
    """A checkpoint's chat template is code from whoever made the checkpoint: it renders in Jinja's immutable
    sandbox, where Python's internals are out of reach and nothing on the host runs (docs/security.md)."""
    hostile = str(tmp_path / "hostile")
    shutil.copytree(hf_dir, hostile)
    canary = tmp_path / "canary"
    with open(os.path.join(hostile, "chat_template.jinja"), "w") as f:
        f.write(payload.replace("CANARY", str(canary)) + CHAT_TEMPLATE)
    config = json.load(open(os.path.join(hostile, "tokenizer_config.json")))
    config.pop("chat_template", None)
    json.dump(config, open(os.path.join(hostile, "tokenizer_config.json"), "w"))
    try:
        _, fmt = for_checkpoint(hostile)
        rendered = fmt.render([{"role": "user", "content": "hi"}])
    except ValueError as e:  # refused in one sentence naming the checkpoint
        assert "refused the conversation" in str(e) and hostile in str(e)
        rendered = ""
    assert "subclasses" not in rendered and "<class" not in rendered and "function" not in rendered
    assert not canary.exists()
