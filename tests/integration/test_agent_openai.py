"""Agent programs of your own through the OpenAI-compatible endpoint (llmtune.rl.agent_program, llmtune.rl.endpoint,
llmtune.rl.recorder), driven by the real `openai` client against real engines, on the tiny model that has learned one
tool conversation (tests/integration/agent_workspace.py).

Pinned: tool calls round-trip in OpenAI's format (JSON-string arguments, call ids, finish reasons, usage, streaming);
a greedy rollout of a plain openai-client agent has exactly the built-in loop's token ids and loss mask (hf and vLLM);
requests that extend the last exchange are joined by ids, a rewritten history becomes segments, each with its own
context and a loss mask of 1 exactly on what was sampled in it; concurrent rollouts never mix; a crashed agent (raised,
non-zero exit, bad output, timeout, no request) is an infrastructure failure that abstains, while an agent that fails
after llmtune refused it for the rollout's own limits is scored as cut; with vLLM a rollout samples the same whatever
it is batched with (per-request seeds); requests without their rollout's key are refused (401) on an endpoint that
listens beyond loopback."""

import json
import math
import socket
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

from llmtune.rl.agent_program import AgentProgram, EndpointSettings, OpenAIAgentLoop, endpoint_metrics
from llmtune.rl.endpoint import Endpoint, Reader
from llmtune.rl.recorder import Renderer
from llmtune.rl.types import ERROR, LENGTH, STOP, TURNS, RolloutBatch, SamplingParams
from tests.integration.agent_workspace import CONVERSATION, QUESTION, calculator_schema
from tests.integration.test_agent_rollouts import (hf_engine, loop, needs_vllm, parts, row, tool_model,  # noqa: F401
                                                   vllm_engine)

openai = pytest.importorskip("openai")
SCHEMA = calculator_schema()


def endpoint_loop(tok, engine, fn=None, argv=None, concurrency=4, timeout_s=60.0, max_turns=4, model_len=512):
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    program = AgentProgram(fn=fn, argv=argv, name="test agent")
    settings = EndpointSettings(concurrency, timeout_s, "127.0.0.1", 0, max_turns, model_len)
    return OpenAIAgentLoop(engine, program, Renderer(tok, stop), Reader(tok, "hermes"), settings), stop


def greedy(stop, budget=96):
    return SamplingParams(budget, tuple(stop), greedy=True)


def client(base_url, api_key):
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def shipped_agent():
    """The example's own agent program (recipes/quickstart_agent_openai.py), loaded as its recipe names it: a plain
    openai-client calculator agent, no llmtune import."""
    from pathlib import Path

    from llmtune.rl.agent_program import load_agent

    import re

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    assert not re.search(r"^\s*(from|import) llmtune", (recipes / "quickstart_agent_openai.py").read_text(), re.M)
    return load_agent("quickstart_agent_openai.py:solve", None, recipes).fn  # as the recipe names it


def test_tool_calls_round_trip_in_openai_format(parts):
    tok, policy = parts
    seen = {}

    def agent(base_url, api_key, row, seed):
        c = client(base_url, api_key)
        messages = list(row["messages"])
        first = c.chat.completions.create(model="my-model", messages=messages, tools=SCHEMA)
        seen["first"] = first
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        stream = c.chat.completions.create(model="my-model", messages=messages, tools=SCHEMA, stream=True,
                                           stream_options={"include_usage": True})
        seen["chunks"] = list(stream)
        return 0.5

    agents, stop = endpoint_loop(tok, hf_engine(tok, policy), agent)
    try:
        [t] = agents.run([row(tok)], greedy(stop))
    finally:
        agents.close()
    first = seen["first"]
    choice = first.choices[0]
    assert (first.object, first.model, choice.finish_reason) == ("chat.completion", "my-model", "tool_calls")
    assert choice.message.role == "assistant" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator" and call.id.startswith("call_")
    assert isinstance(call.function.arguments, str)  # a JSON string, as OpenAI sends arguments
    assert json.loads(call.function.arguments) == {"expression": "2 + 3"}
    assert first.usage.prompt_tokens == len(t.prompt_ids)
    sampled_first = t.loss_mask.index(0)  # the first answer's tokens, then context
    assert first.usage.completion_tokens == sampled_first
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    chunks = seen["chunks"]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == "The answer is 5. #### 5" and finishes == ["stop"]
    assert chunks[-1].usage.completion_tokens == sum(t.loss_mask) - sampled_first
    # recorded: one segment joined by ids, the agent's reward kept for the `agent` reward source
    assert (t.finish_reason, t.turns, t.segments) == (STOP, 2, [])
    o = t.outcome
    assert (o.requests, o.joins, o.splits, o.agent_reward, o.infrastructure_error) == (2, 1, 0, 0.5, None)
    assert o.messages[-1] == {"role": "assistant", "content": "The answer is 5. #### 5"}
    assert o.messages[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "2 + 3"}}


def test_a_greedy_rollout_has_the_built_in_loops_token_ids(parts):
    """The same task through the endpoint, by the example's agent program (recipes/quickstart_agent_openai.py), and
    through llmtune's own loop: the same ids, mask and conversation (hf; two rollouts at once, sampled in batches)."""
    tok, policy = parts
    engine = hf_engine(tok, policy)
    built_in, stop = loop(tok, engine)
    expected = built_in.run([row(tok)] * 2, greedy(stop))
    agents, _ = endpoint_loop(tok, engine, shipped_agent(), concurrency=2)
    try:
        got = agents.run([row(tok)] * 2, greedy(stop))
    finally:
        agents.close()
    for a, b in zip(expected, got):
        assert a.turns == 2 and a.outcome.tool_calls == 1  # a real tool round
        assert (b.prompt_ids, b.completion_ids, b.loss_mask) == (a.prompt_ids, a.completion_ids, a.loss_mask)
        assert (b.finish_reason, b.turns, b.outcome.tool_calls) == (a.finish_reason, a.turns, a.outcome.tool_calls)
        assert [m["content"] for m in b.outcome.messages] == [m["content"] for m in a.outcome.messages]


def test_sampled_rollouts_draw_what_the_built_in_loop_draws_on_a_fixed_seed(parts):
    """Sampled at temperature 2 with one seed: request k of rollout b is seeded as the built-in loop's turn k of
    rollout b (hf, seeded per prompt), so the example's agent samples the built-in loop's ids wherever the two agents
    act alike; another seed draws other ids. (At temperature 1 the tiny model's rollout is its mode with probability
    ~0.7, so four seeds or two seeds could draw equal rollouts by chance: see the vLLM test below.)"""
    tok, policy = parts
    engine = hf_engine(tok, policy)
    built_in, stop = loop(tok, engine)
    sampling = SamplingParams(96, tuple(stop), temperature=2.0, seed=1234)
    expected = built_in.run([row(tok)] * 4, sampling)
    agents, _ = endpoint_loop(tok, engine, shipped_agent(), concurrency=4)
    try:
        got = agents.run([row(tok)] * 4, sampling)
        other = agents.run([row(tok)] * 4, SamplingParams(96, tuple(stop), temperature=2.0, seed=99))
    finally:
        agents.close()
    first = [t.completion_ids[:t.loss_mask.index(0) if 0 in t.loss_mask else None] for t in expected]
    assert [t.completion_ids[:len(f)] for t, f in zip(got, first)] == first  # every first answer
    assert len({tuple(t.completion_ids) for t in expected}) > 1  # four rollouts, four seeds
    alike = [(a, b) for a, b in zip(expected, got) if a.outcome.tool_calls == b.outcome.tool_calls
             and not a.outcome.tool_errors]  # (a malformed call: the two agents differ on purpose)
    assert alike
    for a, b in alike:
        assert (b.prompt_ids, b.completion_ids, b.loss_mask) == (a.prompt_ids, a.completion_ids, a.loss_mask)
    assert [t.completion_ids for t in other] != [t.completion_ids for t in got]


@needs_vllm
def test_vllm_greedy_rollouts_equal_the_built_in_loops_and_seeds_do_not_depend_on_batching(parts, vllm_engine):
    """vLLM: the greedy rollout equals the built-in loop's; sampled at temperature 2, the engine's log-probs cover
    exactly the sampled tokens (NaN on the context), each request's own seed makes a rollout's samples the same
    whether it runs alone or beside others (concurrency 1 vs 4), and they are the built-in loop's on that seed.
    Temperature 2, not 1: the tiny model has learned its conversation so well that at temperature 1 a whole rollout
    is its mode with probability ~0.7 (sequence log-prob -0.36), so four seeds gave four equal rollouts on some
    CPUs (0.7^4: the "four seeds" check failed by chance) and the alone/together check compared modes only."""
    tok, policy = parts
    built_in, stop = loop(tok, vllm_engine)
    [a] = built_in.run([row(tok)], greedy(stop))
    agents, _ = endpoint_loop(tok, vllm_engine, shipped_agent(), concurrency=4)
    try:
        [b] = agents.run([row(tok)], greedy(stop))
        sampling = SamplingParams(96, tuple(stop), temperature=2.0, seed=1234)
        together = agents.run([row(tok)] * 4, sampling)
        agents.settings.concurrency = 1
        alone = agents.run([row(tok)] * 4, sampling)
    finally:
        agents.close()
    assert (b.prompt_ids, b.completion_ids, b.loss_mask) == (a.prompt_ids, a.completion_ids, a.loss_mask)
    alike = [(x, y) for x, y in zip(built_in.run([row(tok)] * 4, sampling), together)
             if x.outcome.tool_calls == y.outcome.tool_calls and not x.outcome.tool_errors]
    assert alike and all(x.completion_ids == y.completion_ids for x, y in alike)
    assert [t.completion_ids for t in together] == [t.completion_ids for t in alone]
    assert len({tuple(t.completion_ids) for t in together}) > 1  # four rollouts, four seeds
    for t in together:
        logps = torch.tensor(t.engine_logps)
        sampled = torch.tensor(t.loss_mask).bool()
        assert torch.isfinite(logps[sampled]).all() and torch.isnan(logps[~sampled]).all()


def test_an_answer_cut_by_a_stop_string_or_max_tokens_joins_with_the_end_of_turn_as_context(parts):
    """A stop string ends the answer before it (the tokens sampled after it are not part of the rollout); an answer
    cut by max_tokens ends with finish_reason length; a request that continues either is joined by ids, with the
    template's end-of-turn token (which the policy did not sample) as context."""
    tok, policy = parts
    seen = {}

    def agent(base_url, api_key, row, seed):
        c = client(base_url, api_key)
        messages = list(row["messages"])
        cut = c.chat.completions.create(model="p", messages=messages, tools=SCHEMA, stop=["calculator"])
        messages += [cut.choices[0].message, {"role": "user", "content": "Go on."}]
        short = c.chat.completions.create(model="p", messages=messages, tools=SCHEMA, max_tokens=3)
        messages += [short.choices[0].message, {"role": "user", "content": "And?"}]
        c.chat.completions.create(model="p", messages=messages, tools=SCHEMA, max_tokens=2)
        seen.update(cut=cut, short=short)

    agents, stop = endpoint_loop(tok, hf_engine(tok, policy), agent)
    try:
        [t] = agents.run([row(tok)], greedy(stop, 200))
    finally:
        agents.close()
    cut, short = seen["cut"].choices[0], seen["short"].choices[0]
    assert cut.finish_reason == "stop" and cut.message.tool_calls is None
    assert cut.message.content == '<tool_call>\n{"name": "'  # the text before the stop string
    assert short.finish_reason == "length" and seen["short"].usage.completion_tokens == 3
    assert (t.outcome.joins, t.outcome.splits, t.segments) == (2, 0, [])
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    k = seen["cut"].usage.completion_tokens
    assert t.loss_mask[:k] == [1] * k and t.loss_mask[k] == 0 and t.completion_ids[k] == eot  # not sampled: context
    assert "calculator" not in tok.decode(t.completion_ids[:k - 1])  # the turn ends where the stop string does
    second = t.loss_mask.index(1, k)
    assert t.completion_ids[second + 3] == eot and t.loss_mask[second + 3] == 0


def test_a_rewritten_history_becomes_segments_each_with_its_own_context(parts):
    tok, policy = parts
    usage = []

    def agent(base_url, api_key, row, seed):
        c = client(base_url, api_key)
        messages = list(row["messages"])
        first = c.chat.completions.create(model="p", messages=messages, tools=SCHEMA)
        usage.append(first.usage.completion_tokens)
        # the agent summarises its memory: the call and its result become one user message, and a system prompt
        rewritten = [{"role": "system", "content": "Be brief."}, *messages,
                     {"role": "user", "content": "The calculator says 2 + 3 = 5. Answer."}]
        second = c.chat.completions.create(model="p", messages=rewritten, tools=SCHEMA)
        usage.append(second.usage.completion_tokens)
        third = c.chat.completions.create(model="p", tools=SCHEMA, messages=[
            *rewritten, second.choices[0].message, {"role": "user", "content": "Sure?"}])
        usage.append(third.usage.completion_tokens)

    agents, stop = endpoint_loop(tok, hf_engine(tok, policy), agent)
    try:
        [t] = agents.run([row(tok)], greedy(stop, 200))
    finally:
        agents.close()
    renderer = agents.renderer
    o = t.outcome
    assert (o.requests, o.joins, o.splits, t.turns, o.infrastructure_error) == (3, 1, 1, 3, None)
    first, second = t.segments
    # segment 1: the row's own prompt, the first answer: every token sampled
    assert first.prompt_ids == row(tok)["input_ids"]
    assert first.loss_mask == [1] * usage[0] and len(first.completion_ids) == usage[0]
    # segment 2: a fresh render of the rewritten history, its answer, the joined follow-up (context), the third answer
    rewritten = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:1],
                 {"role": "user", "content": "The calculator says 2 + 3 = 5. Answer."}]
    assert second.prompt_ids == renderer.prompt_ids(rewritten, SCHEMA)
    between = len(second.loss_mask) - usage[1] - usage[2]
    assert between > 0 and second.loss_mask == [1] * usage[1] + [0] * between + [1] * usage[2]
    follow_up = tok.decode(second.completion_ids[usage[1]:usage[1] + between])
    assert "Sure?" in follow_up and follow_up.rstrip().endswith("assistant")  # the new user turn + the next header
    # the trajectory's own ids are its last segment (the final context); the learner gets one row per segment
    assert (t.prompt_ids, t.completion_ids, t.loss_mask) == (second.prompt_ids, second.completion_ids,
                                                              second.loss_mask)
    batch = RolloutBatch.from_trajectories([t], tok.pad_token_id)
    train, rollout = batch.training_rows()
    assert rollout.tolist() == [0, 0] and train.loss_mask.sum(1).tolist() == [usage[0], usage[1] + usage[2]]
    assert int(batch.sampled_tokens()) == sum(usage)
    assert endpoint_metrics([t])["agent/segments"] == 2.0


def test_n_choices_and_a_second_continuation_branch_with_exact_ids(parts):
    """n=2: each choice is sampled and trained (both are the policy's actions); continuing a choice joins it; asking
    twice from the same exchange starts a segment whose context is that exchange's exact ids."""
    tok, policy = parts
    seen = {}

    def agent(base_url, api_key, row, seed):
        c = client(base_url, api_key)
        messages = list(row["messages"])
        first = c.chat.completions.create(model="p", messages=messages, tools=SCHEMA, n=2)
        seen["n"] = len(first.choices)
        call = first.choices[1].message.tool_calls[0]
        follow = [*messages, first.choices[1].message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        c.chat.completions.create(model="p", messages=follow, tools=SCHEMA)
        c.chat.completions.create(model="p", messages=follow, tools=SCHEMA)  # the same point again

    agents, stop = endpoint_loop(tok, hf_engine(tok, policy), agent)
    try:
        [t] = agents.run([row(tok)], greedy(stop, 200))
    finally:
        agents.close()
    assert seen["n"] == 2
    assert (t.outcome.requests, t.outcome.joins, t.outcome.splits, t.turns) == (3, 1, 1, 4)
    choice0, choice1, again = t.segments
    assert choice0.prompt_ids == choice1.prompt_ids == row(tok)["input_ids"]
    assert set(choice0.loss_mask) == {1}  # the unused choice: trained, its own row
    assert 0 in choice1.loss_mask  # choice 1 joined with the tool result and the answer
    # the branch's context is choice 1's row up to its second answer (the call, the tool result, the header): the
    # same ids, not a re-render
    start = choice1.loss_mask.index(0)
    context = choice1.completion_ids[:start + choice1.loss_mask[start:].index(1)]
    assert again.prompt_ids == choice1.prompt_ids + context and set(again.loss_mask) == {1}


def test_concurrent_rollouts_never_mix(parts):
    tok, policy = parts
    barrier = threading.Barrier(6)

    def agent(base_url, api_key, row, seed):
        c = client(base_url, api_key)
        tag = row["index"]
        messages = [{"role": "user", "content": f"What is 2 + 3? (rollout {tag})"}]
        barrier.wait(30)  # all six ask at once
        for i in range(tag % 3 + 1):
            reply = c.chat.completions.create(model="p", messages=messages, max_tokens=8)
            messages += [reply.choices[0].message, {"role": "user", "content": f"again {tag}.{i}"}]
        return float(tag)

    rows = [{**row(tok), "index": b} for b in range(6)]
    agents, stop = endpoint_loop(tok, hf_engine(tok, policy), agent, concurrency=6)
    try:
        trajectories = agents.run(rows, greedy(stop, 200), groups=[0, 0, 1, 1, 2, 2])
    finally:
        agents.close()
    for b, t in enumerate(trajectories):
        text = tok.decode(t.prompt_ids + t.completion_ids)
        assert f"(rollout {b})" in text and all(f"(rollout {o})" not in text for o in range(6) if o != b)
        assert all(f"again {o}." not in text for o in range(6) if o != b)
        assert (t.outcome.requests, t.outcome.joins, t.outcome.agent_reward, t.group) == (
            b % 3 + 1, b % 3, float(b), [0, 0, 1, 1, 2, 2][b])
        assert t.segments == [] and sum(t.loss_mask) <= 8 * (b % 3 + 1)


def _failing(kind):
    def agent(base_url, api_key, row, seed):
        c = client(base_url, api_key)
        if kind == "no_request":
            return None
        c.chat.completions.create(model="p", messages=list(row["messages"]), tools=SCHEMA)
        if kind == "raises":
            raise RuntimeError("the agent's own bug")
        if kind == "bad_reward":
            return "very good"
        if kind == "timeout":
            threading.Event().wait(3.0)
        if kind == "after_limit":  # llmtune refuses the next request (agent.max_turns = 1); the agent does not cope
            c.chat.completions.create(model="p", messages=list(row["messages"]), tools=SCHEMA)
        return 1.0
    return agent


@pytest.mark.parametrize("kind,failure", [
    ("raises", "the agent raised RuntimeError: the agent's own bug"),
    ("bad_reward", "the agent returned 'very good'; expected a finite number (the reward) or None"),
    ("timeout", "the agent did not return within agent.openai.timeout_s = 1 s"),
    ("no_request", "the agent made no request to the endpoint"),
    ("too_long", "no request of the agent was answered: this rollout's budget is used up"),
    ("after_limit", None),
])
def test_a_crashed_agent_abstains_and_is_counted(parts, kind, failure):
    from llmtune.rewards.shaping import Shaping, Skip, shape

    tok, policy = parts
    agents, stop = endpoint_loop(tok, hf_engine(tok, policy), _failing(kind), timeout_s=1.0,
                                 max_turns=1 if kind == "after_limit" else 4,
                                 model_len=16 if kind == "too_long" else 512)  # the prompt alone is longer
    try:
        [t] = agents.run([row(tok)], greedy(stop))
    finally:
        agents.close()
    batch = RolloutBatch.from_trajectories([t], tok.pad_token_id)
    result = shape(batch, torch.tensor([1.0]), {"answer": torch.tensor([1.0])}, Shaping(96))
    if failure is None:  # refused for the rollout's own limit: the model's doing, scored (as cut)
        assert t.finish_reason == TURNS and t.outcome.infrastructure_error is None
        assert int(result.skip[0]) == Skip.TRAINS
        return
    assert t.finish_reason == ERROR and t.outcome.infrastructure_error.startswith(failure)
    # an infrastructure failure: no reward from any source (never a silent 0), does not train, counted
    assert int(result.skip[0]) == Skip.INFRASTRUCTURE and math.isnan(float(result.sources[0]))
    assert endpoint_metrics([t])["agent/requests"] == (0.0 if kind in ("no_request", "too_long") else 1.0)


COMMAND_AGENT = """import json, os, sys
from openai import OpenAI
row = json.loads(os.environ["LLMTUNE_ROW"])
c = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
reply = c.chat.completions.create(model="p", messages=row["messages"], max_tokens=4)
if row["index"] == 1:
    sys.exit("crashed: " + os.environ["LLMTUNE_SEED"])
print("a log line")
print(0.25 if row["index"] == 0 else "")
"""


def test_a_command_agent_gets_its_rollout_by_environment_and_a_non_zero_exit_abstains(parts, tmp_path):
    tok, policy = parts
    script = tmp_path / "agent.py"
    script.write_text(COMMAND_AGENT)
    agents, stop = endpoint_loop(tok, hf_engine(tok, policy), argv=[sys.executable, str(script)])
    try:
        ok, crashed, silent = agents.run([{**row(tok), "index": b} for b in range(3)], greedy(stop))
    finally:
        agents.close()
    assert (ok.outcome.agent_reward, ok.outcome.requests, ok.finish_reason) == (0.25, 1, LENGTH)  # max_tokens 4
    assert crashed.finish_reason == ERROR and crashed.outcome.infrastructure_error.startswith(
        "the agent command exited with status 1: crashed: ")
    assert silent.outcome.agent_reward is None and silent.outcome.infrastructure_error is None


def _address_beyond_loopback() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: the routing table picks this host's outbound address
        address = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if address.startswith("127.") else address


class _Stub:
    def complete(self, body):
        return {"object": "chat.completion", "choices": [], "echo": body}, None


def test_requests_without_their_rollouts_key_are_refused_beyond_loopback():
    address = _address_beyond_loopback()
    if address is None:
        pytest.skip("this host has no address beyond loopback")
    endpoint = Endpoint("0.0.0.0", 0)  # reachable from outside the host
    try:
        key, other = endpoint.register(_Stub()), endpoint.register(_Stub())
        root = f"http://{address}:{endpoint.port}"

        def post(path, token=None):
            request = urllib.request.Request(root + path, json.dumps({"messages": []}).encode(),
                                             {"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    return answer.status, json.load(answer)
            except urllib.error.HTTPError as exc:
                return exc.code, json.load(exc)

        assert post("/v1/chat/completions")[0] == 401  # no key
        assert post("/v1/chat/completions", "sk-guessed")[0] == 401
        assert post("/v1/chat/completions", key)[0] == 200
        assert post(f"/r/{key}/v1/chat/completions")[0] == 200  # the key in the base URL
        assert post(f"/r/{key}/v1/chat/completions", other)[0] == 401  # one rollout's path, another's key
        status, body = post(f"/r/{other}x/v1/chat/completions")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{root}/v1", api_key="sk-anything", max_retries=0).chat.completions.create(
                model="p", messages=[{"role": "user", "content": QUESTION}])
        endpoint.revoke(key)
        assert post("/v1/chat/completions", key)[0] == 401  # a finished rollout's key
        assert post("/v1/chat/completions", other)[0] == 200
    finally:
        endpoint.close()
