"""Constrained tool calls: the turn grammar accepts every call the template writes, refuses what would not
parse or fit its tool's schema, and the engine under it samples only turns whose calls parse."""

from __future__ import annotations

import json
from collections import Counter

import openai
import pytest
import torch

from codefleet.agent.tools import tool_schemas
from codefleet.chat.codefleet_template import (
    BOS,
    CALL_CLOSE,
    CALL_OPEN,
    END,
    EOS,
    USER,
    encode_chat,
    encode_chat_with_mask,
    stop_ids,
)
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.chat.tool_parser import PARSERS
from codefleet.inference.engine import Engine
from codefleet.inference.grammar import ToolCallGrammar, constrained_sample
from codefleet.inference.sampling import SamplingParams, sample_next
from codefleet.inference.server import ServerThread
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer, token_logprobs
from codefleet.rl.sft import pad_batch, sft_step_loss


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


@pytest.fixture(scope="module")
def grammar(tok):
    return ToolCallGrammar.build(tok, tool_schemas())


def _feed(matcher, tok, text: str, special: str | None = None) -> bool:
    """Feed `text` (plain bytes) then optionally one special token; False at the first refused token."""
    for t in tok.encode(text):
        if not matcher.allows(t):
            return False
        matcher.advance(t)
    if special is not None:
        t = tok.special_id(special)
        if not matcher.allows(t):
            return False
        matcher.advance(t)
    return True


def _call(grammar, tok, body: str, close: bool = True) -> bool:
    m = grammar.start()
    assert _feed(m, tok, "Reading it.", CALL_OPEN)
    return _feed(m, tok, body, CALL_CLOSE if close else None)


CALLS = [
    ("read_file", {"path": "src/app.py", "start_line": 3, "end_line": 40}),
    ("edit_file", {"path": "a b/ü.py", "old_text": 'x = "q"\n\tif a<|b:', "new_text": "y = '\\\\'\r\n"}),
    ("write_file", {"path": "new.py", "content": '<|/tool_call|> and {"json": [1, 2]}'}),
    ("run", {"command": "python3 -m pytest -q tests", "timeout": 12.5}),
    ("run", {"command": "ls", "timeout": -3e-2}),
    ("list_dir", {}),
    ("search", {"pattern": "def (add|sub)\\(", "path": "pkg"}),
    ("submit", {"summary": "renamed it"}),
]


def test_the_grammar_accepts_every_turn_the_template_renders(tok, grammar):
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(CALLS)
    ]
    for message in (
        [{"role": "assistant", "content": "Looking first.", "tool_calls": calls}],
        [{"role": "assistant", "content": "", "tool_calls": calls[:1]}],
        [{"role": "assistant", "content": "No call needed: done."}],
    ):
        ids, mask = encode_chat_with_mask(tok, message, add_generation_prompt=False)
        turn = [t for t, m in zip(ids, mask) if m]
        m = grammar.start()
        for i, t in enumerate(turn):
            assert m.allows(t), (message, tok.decode(turn[: i + 1]))
            m.advance(t)
        assert m.done  # it ended with <|end|>


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "read_file", "arguments": {"path": "a.py"}',  # the call's closing brace is missing
        '{"name": "delete_all", "arguments": {}}',  # no such tool
        '{"arguments": {}, "name": "list_dir"}',  # the arguments depend on the name, which comes first
        '{"name": "submit", "arguments": {"path": "a.py"}}',  # submit takes no path
        '{"name": "edit_file", "arguments": {"path": "a.py", "new_text": "b"}}',  # old_text is required
        '{"name": "read_file", "arguments": {"path": "a.py", "start_line": "3"}}',  # an integer, not a string
        '{"name": "read_file", "arguments": {"path": "a.py", "start_line": 1.5}}',
        '{"name": "read_file", "arguments": {"path": "a.py", "start_line": 01}}',
        '{"name": "run", "arguments": {"command": "ls\n"}}',  # a raw newline inside a JSON string
        '{"name": "run", "arguments": {"command": "l\\qs"}}',  # no such escape
        '{"name": "run", "arguments": {"command": "echo <|end|>"}}',  # "<|" would read as a template marker
        '{"name": "read_file", "arguments": {"path": "a.py", "path": "b.py"}}',
        '{"name": "read_file", "arguments": {"path": "a.py",}}',
        '{"name": "read_file", "arguments": {"path": "a.py"}} {',
        '{"name": "list_dir", "arguments": []}',
    ],
)
def test_the_grammar_refuses_what_would_not_parse_or_fit_the_schema(tok, grammar, body):
    assert not _call(grammar, tok, body)


@pytest.mark.parametrize(
    "body",
    [
        ' { "name" :"list_dir","arguments":{ } } ',
        '{"name": "run", "arguments": {"timeout": 0.5E+2, "command": "ls \\u00e9"}}',
        '{"name": "read_file", "arguments": {"end_line": -0, "path": ""}}',
    ],
)
def test_the_grammar_accepts_json_spelled_in_other_ways(tok, grammar, body):
    assert _call(grammar, tok, body)
    assert not PARSERS["codefleet"].parse(f"{CALL_OPEN}{body}{CALL_CLOSE}").errors


def test_markers_go_only_where_the_template_puts_them(tok, grammar):
    m = grammar.start()
    assert not m.allows(tok.special_id(CALL_CLOSE))  # no call is open
    assert not m.allows(tok.special_id(USER)) and not m.allows(tok.special_id(BOS))
    assert not _feed(grammar.start(), tok, "see <|end|>")
    assert _feed(m, tok, "a < b |", CALL_OPEN)
    assert not m.allows(tok.special_id(END))  # a call is open
    assert not m.allows(tok.special_id(CALL_OPEN))
    assert _feed(m, tok, '{"name": "list_dir", "arguments": {}}', CALL_CLOSE)
    assert _feed(m, tok, "", CALL_OPEN)  # a second call
    assert _feed(m, tok, '{"name": "submit", "arguments": {}}', CALL_CLOSE)
    assert _feed(m, tok, "", END) and m.done
    assert not m.allows(tok.encode("x")[0])


def test_tool_choice_required_and_none(tok):
    required = ToolCallGrammar.build(tok, tool_schemas(), "required").start()
    assert not required.allows(tok.special_id(END)) and not required.allows(tok.special_id(EOS))
    assert _feed(required, tok, "", CALL_OPEN)
    assert _feed(required, tok, '{"name": "list_dir", "arguments": {}}', CALL_CLOSE)
    assert required.allows(tok.special_id(END))
    none = ToolCallGrammar.build(tok, tool_schemas(), "none").start()
    assert not none.allows(tok.special_id(CALL_OPEN)) and none.allows(tok.special_id(END))
    with pytest.raises(ValueError, match="tool_choice"):
        ToolCallGrammar.build(tok, tool_schemas(), "always")
    with pytest.raises(ValueError, match="at least one tool"):
        ToolCallGrammar.build(tok, [])


def test_calls_only_opens_the_turn_with_a_call_and_max_calls_ends_it(tok):
    call_open, end, eos = (tok.special_id(t) for t in (CALL_OPEN, END, EOS))
    only = ToolCallGrammar.build(tok, tool_schemas(), "required", calls_only=True).start()
    assert only.allowed_mask().nonzero().flatten().tolist() == [call_open]  # no text, no end: a call opens the turn
    assert _feed(only, tok, "", CALL_OPEN) and _feed(only, tok, '{"name": "list_dir", "arguments": {}}', CALL_CLOSE)
    assert set(only.allowed_mask().nonzero().flatten().tolist()) == {call_open, end, eos}  # another call or the end
    one = ToolCallGrammar.build(tok, tool_schemas(), "required", calls_only=True, max_calls=1).start()
    assert _feed(one, tok, "", CALL_OPEN) and _feed(one, tok, '{"name": "submit", "arguments": {}}', CALL_CLOSE)
    assert set(one.allowed_mask().nonzero().flatten().tolist()) == {end, eos}
    none = ToolCallGrammar.build(tok, [], "none").start()  # "none" needs no tools
    assert _feed(none, tok, "Plain text.") and not none.allows(call_open) and none.allows(end)
    with pytest.raises(ValueError, match="calls_only"):
        ToolCallGrammar.build(tok, tool_schemas(), "none", calls_only=True)


def test_the_full_mask_is_exactly_the_tokens_it_allows(tok, grammar):
    prefixes = [
        "",
        '{"na',
        '{"name": "run", "arguments": {"command": "py',
        '{"name": "run", "arguments": {"timeout": 1',
        '{"name": "read_file", "arguments": {"path": "a", ',
    ]
    for prefix in prefixes:
        m = grammar.start()
        assert _feed(m, tok, "x", CALL_OPEN) and _feed(m, tok, prefix)
        mask = m.allowed_mask()
        assert mask.tolist() == [m.allows(t) for t in range(len(tok))], prefix
        assert 0 < int(mask.sum()) < len(tok)


def test_constrained_sampling_draws_from_the_model_restricted_to_allowed_tokens(tok, grammar):
    m = grammar.start()
    assert _feed(m, tok, "", CALL_OPEN)
    # after the opening marker only whitespace or "{" may come: give most mass to tokens it refuses
    brace, space = tok.encode("{")[0], tok.encode(" ")[0]
    logits_V = torch.full((len(tok),), -30.0)
    logits_V[tok.encode("hello")] = 8.0
    logits_V[tok.special_id(END)] = 9.0
    logits_V[brace], logits_V[space] = 1.0, 1.0 - float(torch.log(torch.tensor(3.0)))  # 3 : 1
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)

    def draw(row):
        return int(sample_next(row[None], [params], [g])[0][0])

    counts = Counter()
    for _ in range(400):
        first = draw(logits_V)
        token, refused = constrained_sample(m, logits_V, first, draw)
        assert refused >= 1 and m.allows(token)
        counts[token] += 1
    assert set(counts) <= {brace, space}
    assert 0.65 < counts[brace] / 400 < 0.85  # 3 : 1 among the allowed


# -- the engine under the grammar -------------------------------------------------------------------


def _small(vocab: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        n_experts=4,
        top_k=2,
        d_expert=64,
        max_seq_len=512,
    )


@pytest.fixture(scope="module")
def caller(tok):
    """A small model taught for a few seconds to answer with tool calls: it writes them, often wrong."""
    torch.manual_seed(0)
    model = Transformer(_small(len(tok)))
    examples = []
    for i in range(32):
        name, arguments = CALLS[i % len(CALLS)]
        messages = [
            {"role": "user", "content": f"task {i}: use {name}"},
            {
                "role": "assistant",
                "content": "On it.",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
                ],
            },
        ]
        examples.append(encode_chat_with_mask(tok, messages, add_generation_prompt=False))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):
        batch = pad_batch([examples[(step * 8 + j) % len(examples)] for j in range(8)])
        loss, _ = sft_step_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_the_engine_samples_only_calls_that_parse(tok, caller):
    prompts = [
        encode_chat(tok, [{"role": "user", "content": f"task {i}: use {n}"}]) for i, (n, _) in enumerate(CALLS * 4)
    ]
    stop = stop_ids(tok)
    outcomes = {}
    for constrained in (False, True):
        engine = Engine(caller, tok, max_batch=32, max_seq_len=512)
        try:
            params = SamplingParams(
                max_tokens=160,
                temperature=1.0,
                seed=7,
                stop_token_ids=stop,
                tools=tool_schemas() if constrained else None,
                tool_choice="required",
            )
            results = engine.generate(prompts, params)
        finally:
            engine.close()
        finished = [r for r in results if r.finish_reason == "stop"]
        parsed = [PARSERS["codefleet"].parse(r.text) for r in finished]
        outcomes[constrained] = (
            len(finished),
            sum(len(p.errors) for p in parsed),
            sum(len(p.tool_calls) for p in parsed),
            sum(r.refused for r in results),
        )
        if constrained:  # a resampled token records the model's own logprob, as the trainer computes it
            r = max(results, key=lambda r: r.refused)
            tokens_BT = torch.tensor([r.prompt_token_ids + r.token_ids])
            with torch.no_grad():
                lp = token_logprobs(caller(tokens_BT, routing_replay=_replay(r)).logits_BTV[:, :-1], tokens_BT[:, 1:])
            torch.testing.assert_close(
                lp[0, len(r.prompt_token_ids) - 1 :], torch.tensor(r.logprobs), atol=2e-4, rtol=0
            )
    finished, errors, calls, refused = outcomes[True]
    assert finished >= 24 and errors == 0 and calls >= finished and refused > 0  # the grammar stepped in
    assert outcomes[False][3] == 0  # without tools nothing is refused


def _replay(result) -> list[torch.Tensor]:
    experts_TLK = torch.tensor(result.prompt_routed_experts + result.routed_experts)
    return [experts_TLK[None, :, layer] for layer in range(experts_TLK.shape[1])]


def test_the_server_honours_tool_choice_by_constraining_decoding(tok, caller):
    engine = Engine(caller, tok, max_batch=8, max_seq_len=512)
    try:
        with ServerThread(engine, tok, model_name="caller", prompt="bare") as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
            for i in range(4):  # asked for read_file, made to call submit
                response = client.chat.completions.create(
                    model="caller",
                    messages=[{"role": "user", "content": f"task {i}: use read_file"}],
                    tools=tool_schemas(),
                    tool_choice={"type": "function", "function": {"name": "submit"}},
                    max_tokens=160,
                    seed=i,
                )
                choice = response.choices[0]
                assert choice.finish_reason == "tool_calls", choice
                for call in choice.message.tool_calls:
                    assert call.function.name == "submit" and set(json.loads(call.function.arguments)) <= {"summary"}
            bad = [({"type": "function", "function": {"name": "rm_rf"}}, "rm_rf"), ("always", "tool_choice must be")]
            for tool_choice, message in bad:
                with pytest.raises(openai.BadRequestError, match=message):
                    client.chat.completions.create(
                        model="caller",
                        messages=[{"role": "user", "content": "x"}],
                        tools=tool_schemas(),
                        tool_choice=tool_choice,
                    )
            with pytest.raises(openai.BadRequestError, match="cannot constrain"):
                client.chat.completions.create(
                    model="caller",
                    messages=[{"role": "user", "content": "x"}],
                    tools=[{"type": "function", "function": {"name": 'say "hi"'}}],
                    tool_choice="required",
                )
    finally:
        engine.close()


def test_the_local_policy_constrains_a_bare_prompts_calls_to_the_harness_tools(tok, caller):
    from codefleet.agent.clients.local_engine import LocalEnginePolicy, grammar_options

    engine = Engine(caller, tok, max_batch=8, max_seq_len=512)
    try:
        policy = LocalEnginePolicy(engine=engine, max_tokens=160, seed=3, **grammar_options("required"))
        names = {s["function"]["name"] for s in tool_schemas()}
        for i, (name, _) in enumerate(CALLS):
            out = policy.generate([{"role": "user", "content": f"task {i}: use {name}"}], [])  # the bare prompt
            assert out.finish_reason == "tool_calls" and out.tool_calls, out
            assert all(c.error is None and c.name in names for c in out.tool_calls), out.tool_calls
    finally:
        engine.close()
    with pytest.raises(ValueError, match="off, auto or required"):
        grammar_options("strict")
