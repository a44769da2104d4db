"""Multi-turn rollouts (llmtune.rl.agent) driven through the real engines by a tiny model that has learned one tool
conversation (tests/integration/agent_workspace.py): the trajectory's ids are the full render of the conversation
token for token (prompt + sampled turns + the template's tool-message ids), the loss mask is 1 exactly on what the
policy sampled, every failure kind goes back to the model as a counted tool result (infrastructure: the rollout
fails and abstains), the budget counts every token, the turn cap ends a trajectory, and with vLLM the engine's
log-probs equal the trainer's on every sampled token of every turn (ratio 1)."""

import math
import time

import pytest
import torch

from llmtune.rl.agent import ERROR, TURNS, AgentLoop, AgentSettings
from llmtune.rl.chat import ToolTurns
from llmtune.rl.engines import Policy
from llmtune.rl.engines.hf import HFEngine
from llmtune.rl.types import LENGTH, STOP, RolloutBatch, SamplingParams
from llmtune.tools import calculator
from tests.integration.agent_workspace import CONVERSATION, QUESTION, assistant_mask, calculator_schema, \
    tool_calling_model

TOL = 2e-4


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return tool_calling_model(tmp_path_factory.mktemp("agent") / "model")


@pytest.fixture(scope="module")
def parts(tool_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    base = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")).eval()
    return tok, policy


def row(tok):
    from llmtune.data.prompts import prompt_ids

    messages = CONVERSATION[:1]
    import json
    return {"input_ids": prompt_ids(tok, messages, tools=calculator_schema()), "messages": json.dumps(messages),
            "prompt": QUESTION, "reference": "5", "index": 0}


def loop(tok, engine, tools=(calculator,), max_turns=4, timeout=5.0):
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    schemas = calculator_schema()
    from llmtune.data.prompts import prompt_ids

    turns = ToolTurns(tok, schemas, stop)
    return AgentLoop(engine, tok, turns, list(tools), None, AgentSettings(max_turns, 64, timeout, "hermes"),
                     lambda messages: prompt_ids(tok, messages, tools=schemas), 256), stop


def hf_engine(tok, policy):
    return HFEngine(Policy(policy, "default", lambda: 0), tok.pad_token_id)


def test_a_greedy_rollout_is_the_full_render_of_its_conversation_token_for_token(parts):
    tok, policy = parts
    agent, stop = loop(tok, hf_engine(tok, policy))
    [t] = agent.run([row(tok)], SamplingParams(96, tuple(stop), greedy=True))
    assert (t.turns, t.finish_reason, t.outcome.tool_calls, t.outcome.tool_errors) == (2, STOP, 1, {})
    messages = t.outcome.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    assert messages[2]["content"] == "5" and messages[3]["content"] == "The answer is 5. #### 5"
    # the ids the policy saw and will be trained on ARE the template's render of that conversation
    full, mask = assistant_mask(tok, CONVERSATION, calculator_schema())
    tail = agent.turns.encode(agent.turns.tail)  # the template's "\n" after the last <|im_end|>: not sampled
    assert t.prompt_ids + t.completion_ids + tail == full
    assert t.loss_mask + [0] * len(tail) == mask[len(t.prompt_ids):]
    assert sum(t.loss_mask) < len(t.loss_mask)  # the tool result and the template's tokens are context, not trained
    batch = RolloutBatch.from_trajectories([t], tok.pad_token_id)
    assert batch.ended.tolist() == [True] and int(batch.loss_mask.sum()) == sum(mask)


class KeyRecorder:
    """The engine's calls as the agent loop makes them: the server key of every prompt of every turn."""

    def __init__(self, engine):
        self.engine, self.keys = engine, []

    def generate(self, prompts, sampling, budgets=None, keys=None, version=None):
        self.keys.append(list(keys))
        return self.engine.generate(prompts, sampling, budgets)


def test_every_turn_of_a_trajectory_goes_to_its_groups_server(parts):
    """Over several servers, a prompt's key picks its server (tests/unit/rl/test_server_routing.py): every turn of
    a trajectory carries its group as key, so all its turns (and its group's) are served by one server. (The first
    turns are one batch; later turns are batched as their tools return.)"""
    tok, policy = parts
    recorder = KeyRecorder(hf_engine(tok, policy))
    agent, stop = loop(tok, recorder)
    trajectories = agent.run([row(tok)] * 3, SamplingParams(96, tuple(stop), greedy=True), groups=[4, 4, 9])
    assert [t.turns for t in trajectories] == [2, 2, 2]
    assert recorder.keys[0] == [4, 4, 9] and sorted(sum(recorder.keys[1:], [])) == [4, 4, 9]
    agent.settings.lockstep = True
    recorder.keys.clear()
    agent.run([row(tok)] * 3, SamplingParams(96, tuple(stop), greedy=True), groups=[4, 4, 9])
    assert recorder.keys == [[4, 4, 9], [4, 4, 9]]


def slow_calculator(latencies):
    """The calculator, each call after its own latency (drawn in order from ``latencies``)."""
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "(12 * 7 + 3) / 2".
        """
        time.sleep(next(latencies))
        return "5"

    return calculator


def test_rollouts_on_their_own_are_the_lockstep_rollouts_and_a_seed_fixes_them_whatever_the_timing(parts):
    """The real hf engine, 6 rollouts: greedy, the trajectories of both schedules are the same token for token;
    sampled (temperature 1.5: the turns differ between rollouts), a seed gives the same trajectories in two runs
    whose tools take other times (the engine's batches differ), another seed other ones."""
    import itertools
    import random

    tok, policy = parts
    engine = hf_engine(tok, policy)
    rows = [row(tok)] * 6

    def run(schedule, sampling, latency_seed):
        rng = random.Random(latency_seed)
        latencies = (rng.choice([0.0, 0.05, 0.3]) for _ in itertools.count())
        agent, _ = loop(tok, engine, tools=(slow_calculator(latencies),))
        agent.settings.lockstep = schedule == "lockstep"
        out = agent.run(rows, sampling)
        return [(t.completion_ids, t.loss_mask, t.turns, t.finish_reason) for t in out]

    stop = (tok.convert_tokens_to_ids("<|im_end|>"),)
    greedy = SamplingParams(96, stop, greedy=True)
    assert run("lockstep", greedy, 0) == run("overlap", greedy, 1)
    sampled = SamplingParams(96, stop, temperature=1.5, seed=7)
    first, second = run("overlap", sampled, 2), run("overlap", sampled, 3)
    assert first == second
    assert len({tuple(t[0]) for t in first}) > 1  # the rollouts differ from each other
    assert run("overlap", SamplingParams(96, stop, temperature=1.5, seed=8), 2) != first


def tool(fn_body: str, name: str = "calculator", params: str = "expression: str"):
    scope = {}
    exec(f"def {name}({params}) -> str:\n    \"\"\"A tool.\n\n    Args:\n        "
         f"{params.split(':')[0]}: the input.\n    \"\"\"\n{fn_body}", {"InfrastructureError": InfraError, "time": time},
         scope)
    return scope[name]


from llmtune.rl.toolbox import InfrastructureError as InfraError  # noqa: E402


@pytest.mark.parametrize("kind,make,expect", [
    ("raised", lambda: tool("    raise ValueError('no calculator today')"), "Error: calculator raised ValueError"),
    ("timeout", lambda: tool("    time.sleep(2.0)\n    return '5'"), "Error: calculator did not return within 0.2 s"),
    ("unknown_tool", lambda: tool("    return 'x'", name="weather", params="city: str"), "Error: unknown tool"),
    ("bad_arguments", lambda: tool("    return 'x'", params="formula: str"), "Error: bad arguments for calculator"),
])
def test_tool_failures_go_back_to_the_model_and_are_counted(parts, kind, make, expect):
    tok, policy = parts
    agent, stop = loop(tok, hf_engine(tok, policy), tools=(make(),), timeout=0.2)
    [t] = agent.run([row(tok)], SamplingParams(200, tuple(stop), greedy=True))  # room for a cut error message
    assert t.outcome.tool_errors == {kind: 1} and t.outcome.tool_calls >= 1
    result = t.outcome.messages[2]
    assert result["role"] == "tool" and result["content"].startswith(expect), result
    assert t.finish_reason != ERROR and not t.outcome.infrastructure_error  # the model's doing: the rollout goes on
    assert t.turns >= 2  # it answered after the error


def test_an_infrastructure_failure_ends_the_rollout_without_a_score(parts):
    tok, policy = parts
    broken = tool("    raise InfrastructureError('the sandbox is down')")
    agent, stop = loop(tok, hf_engine(tok, policy), tools=(broken,))
    [t] = agent.run([row(tok)], SamplingParams(96, tuple(stop), greedy=True))
    assert t.finish_reason == ERROR and "the sandbox is down" in t.outcome.infrastructure_error
    assert t.turns == 1 and len(t.outcome.messages) == 2  # nothing was fed back


def test_the_budget_counts_the_tool_results_and_the_turn_cap_ends_a_rollout(parts):
    tok, policy = parts
    agent, stop = loop(tok, hf_engine(tok, policy))
    [first] = agent.run([row(tok)], SamplingParams(96, tuple(stop), greedy=True))
    turn1 = first.loss_mask.index(0)  # the first turn's sampled tokens
    message = first.loss_mask.index(1, turn1) - turn1  # the tool message and the next assistant header
    # room for the tool message, not one token after it: the result is appended, nothing more is sampled
    [t] = agent.run([row(tok)], SamplingParams(turn1 + message, tuple(stop), greedy=True))
    assert t.finish_reason == LENGTH and t.turns == 1 and t.outcome.tool_calls == 1
    assert t.loss_mask == [1] * turn1 + [0] * message and t.completion_ids == first.completion_ids[:turn1 + message]
    # room for 3 tokens of it: not even an empty result would leave a token to sample, so the call is not run
    [cut] = agent.run([row(tok)], SamplingParams(turn1 + 3, tuple(stop), greedy=True))
    assert cut.finish_reason == LENGTH and cut.turns == 1 and cut.outcome.tool_calls == 0
    assert cut.completion_ids == first.completion_ids[:turn1] and cut.loss_mask == [1] * turn1
    capped, _ = loop(tok, hf_engine(tok, policy), max_turns=1)
    [c] = capped.run([row(tok)], SamplingParams(96, tuple(stop), greedy=True))
    assert c.finish_reason == TURNS and c.turns == 1 and c.outcome.tool_calls == 0
    assert c.completion_ids == first.completion_ids[:turn1]


# ---- vLLM --------------------------------------------------------------------------------------------------
from llmtune.rl.engines.vllm_client import vllm_python  # noqa: E402

needs_vllm = pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (bash scripts/setup.sh)")


@pytest.fixture(scope="module")
def vllm_engine(tool_model, parts, tmp_path_factory):
    import json

    from llmtune.rl.engines.vllm_client import _stop, start_colocated
    from llmtune.rl.engines.vllm_engine import VLLMEngine, VLLMSettings

    tok, policy = parts
    settings = VLLMSettings(max_model_len=512, max_lora_rank=4, dtype="float32", startup_timeout_s=300,
                            request_timeout_s=120, temperature=1.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMTUNE_VLLM_ENGINE_ARGS", json.dumps({"kv_cache_memory_bytes": 64 << 20}))
        client = start_colocated(tool_model, settings, tmp_path_factory.mktemp("agent_vllm"))
    engine = VLLMEngine(client, Policy(policy, "default", lambda: 0), settings)
    engine.sync(0)
    yield engine
    _stop(client.process)


@needs_vllm
def test_vllm_gives_the_same_greedy_rollout(parts, vllm_engine):
    tok, policy = parts
    hf_loop, stop = loop(tok, hf_engine(tok, policy))
    vllm_loop, _ = loop(tok, vllm_engine)
    [a] = hf_loop.run([row(tok)], SamplingParams(96, tuple(stop), greedy=True))
    [b] = vllm_loop.run([row(tok)], SamplingParams(96, tuple(stop), greedy=True))
    assert (a.completion_ids, a.loss_mask, a.turns) == (b.completion_ids, b.loss_mask, b.turns)


@needs_vllm
def test_on_policy_ratio_is_one_on_every_sampled_token_of_every_turn(parts, vllm_engine):
    """Sampled at temperature 1 with the engine's log-probs: the trainer's log-probs (masked LM head at the sampled
    tokens only) equal the engine's across all turns; the tool tokens have no engine log-prob and no weight."""
    from llmtune.rl import ops
    from llmtune.rl.model import PolicyModel

    tok, policy = parts
    agent, stop = loop(tok, vllm_engine)
    torch.manual_seed(0)
    trajectories = agent.run([row(tok)] * 4, SamplingParams(96, tuple(stop), temperature=1.0))
    assert any(t.turns >= 2 for t in trajectories)
    batch = RolloutBatch.from_trajectories(trajectories, tok.pad_token_id)
    with torch.no_grad():
        out = PolicyModel(policy).response_logps(**batch.model_inputs(), responses=batch.completion_ids,
                                                 response_mask=batch.completion_mask, score_mask=batch.loss_mask)
    sampled = batch.loss_mask.bool()
    assert (sampled != batch.completion_mask.bool()).any()  # tool tokens in the middle
    diff = (out.logps - batch.engine_logps)[sampled].abs().max()
    assert float(diff) < TOL, float(diff)
    context = batch.completion_mask.bool() & ~sampled
    assert torch.isnan(batch.engine_logps[context]).all() and (out.logps[context] == 0).all()
    weights = ops.truncated_is_weights(out.logps, batch.engine_logps, batch.loss_mask.float(), cap=2.0)
    assert ((weights - 1).abs()[sampled] < TOL).all() and (weights[context] == 0).all()
    assert math.isfinite(float(weights.sum()))
