"""The agent loop end to end: a real HTTP server speaking the OpenAI protocol, real sandboxes."""

from __future__ import annotations

import json
import threading
import time

import pytest
from openai_stub import OpenAIStub, call, fail, raw, reply

from codefleet.agent import AgentLoop, PolicyError, PolicyOutput, build_messages
from codefleet.agent.clients import LocalEngineUnavailableError, OpenAIConfig, OpenAIPolicy, build_policy
from codefleet.agent.episode import solve
from codefleet.types import Budgets, Failure


def policy_for(stub: OpenAIStub, **options) -> OpenAIPolicy:
    return OpenAIPolicy(OpenAIConfig(base_url=stub.base_url, timeout_s=10, **options))


def tool_messages(request: dict) -> list[tuple[str, str]]:
    """(tool_call_id, content) of the tool messages at the end of a request."""
    out = []
    for m in reversed(request["messages"]):
        if m["role"] != "tool":
            break
        out.insert(0, (m["tool_call_id"], m["content"]))
    return out


def test_parallel_calls_run_concurrently_and_come_back_in_call_order(sandbox):
    script = [
        reply(
            "two slow commands and a read at once",
            call("run", {"command": "sleep 0.5; echo first"}, id="a"),
            call("run", {"command": "sleep 0.5; echo second"}, id="b"),
            call("read_file", {"path": "pkg/calc.py", "end_line": 1}, id="c"),
        ),
        reply("done", call("submit", {"summary": "looked around"}, id="d")),
    ]
    with OpenAIStub(script) as stub:
        trajectory = AgentLoop(policy_for(stub), sandbox).run(build_messages("look around"))
    assert trajectory.stop_reason == "submit" and trajectory.n_turns == 2
    first = trajectory.turns[0]
    assert first.tool_s < 0.9, first.tool_s  # 2 x 0.5 s in sequence would be >= 1 s
    assert [r.duration_s >= 0.5 for r in first.tool_results] == [True, True, False]
    # the model saw one tool message per call, in call order, with the right ids
    assert tool_messages(stub.requests[1]) == [
        ("a", "first\n[exit code 0]"),
        ("b", "second\n[exit code 0]"),
        ("c", "     1\tdef add(a, b):"),
    ]
    assert [t["function"]["name"] for t in stub.requests[0]["tools"]] == [
        "search",
        "read_file",
        "edit_file",
        "write_file",
        "list_dir",
        "run",
        "submit",
    ]
    assert stub.requests[0]["model"] == "stub-model"  # discovered from GET /v1/models
    assert first.prompt_tokens > 0 and first.completion_tokens > 0 and trajectory.tokens > 0
    assert trajectory.tool_s == pytest.approx(sum(t.tool_s for t in trajectory.turns))
    assert trajectory.model_s > 0 and trajectory.wall_s >= trajectory.tool_s


def like_vllm(item):
    """`item`, unless the history holds tool-call arguments that are not JSON: then 400, as vLLM answers."""

    def answer(body: dict):
        for message in body["messages"]:
            for tc in message.get("tool_calls") or []:
                try:
                    json.loads(tc["function"]["arguments"])
                except ValueError as e:
                    return fail(400, f"arguments are not JSON: {e}")
        return item

    return answer


def test_malformed_output_becomes_error_observations_and_the_episode_goes_on(sandbox):
    script = [
        reply(
            "",
            call("read_file", '{"path": "pkg/calc.py"', id="bad_json"),
            call("delete_everything", {"path": "."}, id="unknown"),
            call("edit_file", {"path": "pkg/calc.py"}, id="missing"),
            call("read_file", {"path": "pkg/calc.py", "start_line": "one"}, id="mistyped"),
            call("write_file", {"path": "x.txt", "content": "x" * 300_000}, id="huge"),
            call("read_file", {"path": "README.md"}, id="fine"),
            call("list_dir", "", id="no_arguments"),
        ),
        like_vllm(reply("", call("edit_file", {"path": "pkg/calc.py", "old_text": "a - b", "new_text": "b - a"}))),
        like_vllm(reply("All done, nothing else to do.")),
    ]
    with OpenAIStub(script) as stub:
        trajectory = AgentLoop(policy_for(stub), sandbox).run(build_messages("fix it"))
    assert trajectory.stop_reason == "no_tool_calls" and trajectory.n_turns == 3
    seen = dict(tool_messages(stub.requests[1]))
    assert "not valid JSON" in seen["bad_json"]
    assert "unknown tool 'delete_everything'" in seen["unknown"]
    assert "needs the argument 'old_text'" in seen["missing"]
    assert "must be a integer" in seen["mistyped"]
    assert "over the cap" in seen["huge"]
    assert seen["fine"] == "     1\t# demo"
    assert len(trajectory.turns[0].errors) == 5 and trajectory.turns[1].errors == []
    sent = {tc["id"]: tc["function"]["arguments"] for tc in stub.requests[1]["messages"][-8]["tool_calls"]}
    assert sent["bad_json"] == "{}" and sent["no_arguments"] == "{}"  # the server is sent valid JSON ...
    assert sent["fine"] == '{"path": "README.md"}'
    assert trajectory.turns[0].tool_calls[0].raw_arguments == '{"path": "pkg/calc.py"'  # ... the record keeps it
    assert "return b - a" in sandbox.read_file("pkg/calc.py")  # the episode went on and the edit landed
    assert not any(e.path == "x.txt" for e in sandbox.list_dir("."))


def _looping(n: int, **reply_kwargs) -> list:
    return [reply(f"step {i}", call("run", {"command": f"echo {i}"}), **reply_kwargs) for i in range(n)]


@pytest.mark.parametrize(
    "budgets, script, reason, turns, calls",
    [
        (Budgets(max_turns=2), _looping(5), "max_turns", 2, 2),
        (
            Budgets(max_tool_calls=3),
            [reply("", call("run", {"command": "echo a"}), call("run", {"command": "echo b"})) for _ in range(3)],
            "max_tool_calls",
            2,
            4,
        ),
        (Budgets(max_tokens=2500), _looping(5, usage=(1000, 10)), "max_tokens", 3, 3),
    ],
)
def test_budgets_stop_the_episode_with_the_right_reason(sandbox, budgets, script, reason, turns, calls):
    with OpenAIStub(script) as stub:
        trajectory = AgentLoop(policy_for(stub), sandbox, budgets).run(build_messages("loop"))
    assert (trajectory.stop_reason, trajectory.n_turns, trajectory.n_tool_calls) == (reason, turns, calls)
    assert len(stub.requests) == turns
    if reason == "max_tool_calls":  # the call over budget was answered, not run
        last = trajectory.turns[-1].tool_results
        assert last[0].ok and not last[1].ok and "budget" in last[1].output


def test_wall_clock_budget_also_caps_a_running_command(sandbox):
    script = [reply("", call("run", {"command": "sleep 30", "timeout": 60}))]
    with OpenAIStub(script) as stub:
        started = time.perf_counter()
        trajectory = AgentLoop(policy_for(stub), sandbox, Budgets(wall_clock_s=1.5)).run(build_messages("wait"))
    assert trajectory.stop_reason == "wall_clock"
    assert time.perf_counter() - started < 6
    assert "timed out" in trajectory.turns[0].tool_results[0].output


def test_a_model_call_the_wall_clock_cuts_short_ends_the_episode_as_wall_clock(sandbox):
    script = [reply("", call("list_dir", {}), delay_s=5)]
    with OpenAIStub(script) as stub:
        policy = policy_for(stub, deadline=time.monotonic() + 1.0, max_retries=0)
        trajectory = AgentLoop(policy, sandbox, Budgets(wall_clock_s=1.0)).run(build_messages("wait"))
    assert trajectory.stop_reason == "wall_clock" and trajectory.wall_s < 4
    assert "error" in trajectory.metadata  # what the endpoint said, for the record


def test_injected_correction_reaches_the_next_request(sandbox):
    holder: dict[str, AgentLoop] = {}

    def first_turn(body: dict):
        # The user types while the model is thinking: inject from another thread (the server's).
        holder["loop"].inject("Use multiplication, not addition.")
        return reply("", call("run", {"command": "sleep 0.2; echo working"}))

    script = [first_turn, reply("", call("submit", {}))]
    with OpenAIStub(script) as stub:
        loop = AgentLoop(policy_for(stub), sandbox)
        holder["loop"] = loop
        events: list[dict] = []
        loop.on_event = events.append
        trajectory = loop.run(build_messages("change calc"))
    assert trajectory.stop_reason == "submit"
    assert all(m["content"] != "Use multiplication, not addition." for m in stub.requests[0]["messages"])
    second = stub.requests[1]["messages"]
    assert second[-1] == {"role": "user", "content": "Use multiplication, not addition."}
    assert second[-2]["role"] == "tool"  # after the tool results of the turn it interrupted
    assert {"event": "correction", "text": "Use multiplication, not addition."} in events


def test_inject_is_thread_safe_under_concurrent_callers(sandbox):
    with OpenAIStub([reply("", call("run", {"command": "sleep 0.3"})), reply("ok")]) as stub:
        loop = AgentLoop(policy_for(stub), sandbox)
        senders = [
            threading.Thread(target=lambda i=i: [loop.inject(f"note {i}-{j}") for j in range(25)]) for i in range(4)
        ]
        for s in senders:
            s.start()
        for s in senders:
            s.join()
        loop.run(build_messages("x"))
    notes = [m["content"] for m in stub.requests[0]["messages"] if m["content"].startswith("note ")]
    assert len(notes) == 100 and len(set(notes)) == 100


def test_server_errors_are_retried_with_backoff(sandbox):
    script = [fail(500), reply("", call("submit", {"summary": "ok"}))]
    with OpenAIStub(script) as stub:
        trajectory = AgentLoop(policy_for(stub, max_retries=2), sandbox).run(build_messages("x"))
    assert trajectory.stop_reason == "submit" and len(stub.requests) == 2
    assert stub.request_times[1] - stub.request_times[0] >= 0.015  # waited (Retry-After) before retrying


def test_persistent_failure_ends_the_episode_with_a_clear_error(sandbox):
    with OpenAIStub([fail(503, "overloaded")] * 3) as stub:
        trajectory = AgentLoop(policy_for(stub, max_retries=1), sandbox).run(build_messages("x"))
        url = stub.base_url
    assert trajectory.stop_reason == "error" and trajectory.n_turns == 0 and trajectory.failure == Failure.POLICY
    error = trajectory.metadata["error"]
    assert url in error and "HTTP 503" in error and "overloaded" in error and len(stub.requests) == 2


def test_a_policy_failure_says_its_kind_and_a_finished_episode_has_none(sandbox):
    class EngineGone(RuntimeError):
        failure = Failure.ENGINE_DIED

    class Dies:
        name = "dies"

        def generate(self, messages, tools):
            raise EngineGone("the engine actor died")

    trajectory = AgentLoop(Dies(), sandbox).run(build_messages("x"))
    assert trajectory.stop_reason == "error" and trajectory.failure == Failure.ENGINE_DIED
    assert trajectory.metadata["error"] == "EngineGone: the engine actor died"
    with OpenAIStub([reply("", call("submit", {"summary": "ok"}))]) as stub:
        assert AgentLoop(policy_for(stub), sandbox).run(build_messages("x")).failure is None


def test_unreachable_and_wrong_urls_name_what_to_check():
    with OpenAIStub() as stub:
        url = stub.base_url
        wrong = stub.base_url.removesuffix("/v1")  # a common mistake: the /v1 left off
        with pytest.raises(PolicyError, match="ends with /v1"):
            OpenAIPolicy(OpenAIConfig(base_url=wrong, model="m", max_retries=0)).generate([], [])
    with pytest.raises(PolicyError, match=f"could not connect to the model endpoint {url}.*server is running"):
        OpenAIPolicy(OpenAIConfig(base_url=url, model="m", max_retries=0, timeout_s=2)).generate(
            [{"role": "user", "content": "hi"}], []
        )


def _completion(**choice) -> dict:
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", **choice}],
        "usage": {"prompt_tokens": "12", "completion_tokens": None},
    }


def test_answers_that_bend_the_protocol_are_read_or_refused_with_one_sentence():
    parts = {
        "role": "assistant",
        "content": [{"type": "text", "text": "hello "}, {"type": "image_url"}, {"type": "text", "text": "world"}],
    }
    with OpenAIStub(
        [
            raw(_completion(message=parts)),
            raw(_completion(message=None)),
            raw(_completion()),
            raw({"error": {"message": "overloaded"}}),
        ]
    ) as stub:
        policy = policy_for(stub, max_retries=0)
        output = policy.generate([{"role": "user", "content": "hi"}], [])
        assert (output.text, output.prompt_tokens, output.completion_tokens) == ("hello world", 12, 0)
        for expected in ["a choice without a message", "a choice without a message", "without a list of choices"]:
            with pytest.raises(PolicyError, match=f"{stub.base_url} answered {expected}.*chat-completions"):
                policy.generate([{"role": "user", "content": "hi"}], [])


def test_backends_are_chosen_by_name_and_the_local_engine_needs_a_checkpoint():
    assert isinstance(build_policy("http://localhost:1/v1", "m"), OpenAIPolicy)
    with pytest.raises(LocalEngineUnavailableError, match="local:DIR"):
        build_policy("local")
    assert issubclass(LocalEngineUnavailableError, NotImplementedError)
    with pytest.raises(ValueError, match="OpenAI-compatible base URL"):
        build_policy("ftp://nowhere")


def test_planner_writes_the_plan_and_the_executor_follows_it(sandbox):
    plan = "1. Read pkg/calc.py.\n2. Make sub return b - a.\n3. Submit."
    with (
        OpenAIStub([reply(plan)], model="big-planner") as planner_stub,
        OpenAIStub(
            [
                reply(
                    "following the plan",
                    call("edit_file", {"path": "pkg/calc.py", "old_text": "return a - b", "new_text": "return b - a"}),
                ),
                reply("", call("submit", {"summary": "done"})),
            ],
            model="fast-executor",
        ) as executor_stub,
    ):
        trajectory = solve(sandbox, "Reverse sub.", policy_for(executor_stub), planner=policy_for(planner_stub))
    planner_request = planner_stub.requests[0]
    assert "tools" not in planner_request and planner_request["model"] == "big-planner"
    assert "pkg/calc.py" in planner_request["messages"][-1]["content"]  # it saw the repository layout
    first = executor_stub.requests[0]["messages"]
    assert first[0]["role"] == "system" and "Reverse sub." in first[1]["content"]
    assert first[2]["role"] == "user" and plan in first[2]["content"]
    assert trajectory.stop_reason == "submit" and trajectory.metadata["plan"] == plan
    assert trajectory.metadata["planner_tokens"] > 0
    assert "return b - a" in sandbox.read_file("pkg/calc.py")


class _TokenPolicy:
    """A deterministic in-process model: stands in for the local engine's token-level output."""

    name = "token-policy"

    def generate(self, messages: list[dict], tools: list[dict]) -> PolicyOutput:
        from codefleet.agent import parse_tool_call

        n = sum(m["role"] == "assistant" for m in messages)
        calls = (
            [parse_tool_call("", "list_dir", "{}"), parse_tool_call("", "list_dir", "{}")]
            if n == 0
            else [parse_tool_call("", "submit", json.dumps({"summary": "s"}))]
        )
        return PolicyOutput(
            "",
            calls,
            prompt_tokens=7,
            completion_tokens=3,
            token_ids=[1, 2, 3],
            logprobs=[-0.1, -0.2, -0.3],
            policy_versions=[4, 4, 4],
            routed_experts=[[0, 1]] * 3,
        )


def test_rl_token_fields_and_missing_call_ids_are_kept_per_turn(sandbox):
    trajectory = AgentLoop(_TokenPolicy(), sandbox).run(build_messages("x"))
    turn = trajectory.turns[0]
    assert turn.token_ids == [1, 2, 3] and turn.logprobs == [-0.1, -0.2, -0.3]
    assert turn.policy_versions == [4, 4, 4] and turn.routed_experts == [[0, 1]] * 3
    ids = [c.id for c in turn.tool_calls]
    assert ids == ["call_0_0", "call_0_1"]  # ids filled in, unique, and used in the transcript
    assert [m["tool_call_id"] for m in trajectory.messages if m["role"] == "tool"][:2] == ids


def test_cancel_stops_before_the_next_turn(sandbox):
    holder: dict[str, AgentLoop] = {}

    def first_turn(body: dict):
        holder["loop"].cancel()  # e.g. Ctrl-C while the model is thinking
        return reply("", call("run", {"command": "echo still runs"}))

    with OpenAIStub([first_turn] + _looping(3)) as stub:
        holder["loop"] = AgentLoop(policy_for(stub), sandbox)
        trajectory = holder["loop"].run(build_messages("x"))
    assert trajectory.stop_reason == "cancelled" and trajectory.n_turns == 1 and len(stub.requests) == 1
    assert trajectory.turns[0].tool_results[0].output == "still runs\n[exit code 0]"


def test_prompt_styles():
    full, bare = build_messages("fix it", "pytest"), build_messages("fix it", "pytest", prompt="bare")
    assert [m["role"] for m in full] == ["system", "user"] and bare == full[1:]
    with pytest.raises(ValueError, match="'full'.*'bare'"):
        build_messages("fix it", prompt="short")
