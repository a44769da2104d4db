"""Multi-turn rollouts and the chat template: the token ids the template puts between two assistant turns.

A multi-turn rollout is token-in/token-out (:mod:`llmtune.rl.agent`): the next turn's input is the previous ids + the
ids the policy sampled + the ids of the tool / environment messages. Those last ids come from the model's chat
template, never from decoding and re-encoding the conversation. :class:`ToolTurns` computes them:

    after an assistant turn that ended on its stop token (the template's end of turn, sampled by the policy):
    ids = encode(the template's text after that end-of-turn token      (ChatML: "\\n")
                 + the tool messages as the template renders them      (ChatML + tools: "<|im_start|>user\\n<tool_response>...")
                 + the next assistant header)                           ("<|im_start|>assistant\\n")

rendered from a fixed probe conversation (so the text depends only on the template and the tool messages). A suffix
diff of two renders of the REAL conversation would not do: the template re-renders the assistant's tool calls in its
own format (not the sampled text), and the text after the end-of-turn token (ChatML's "\\n") is in neither the
sampled ids nor the diff.

:func:`check_tool_template` runs when a run starts (``llmtune validate`` too, before any weights): the template must
render tool schemas, tool calls and tool results (many templates cannot: a recipe error naming
``data.chat_template``), keep the history it rendered (templates that rewrite earlier turns, such as Qwen3's stripping
of earlier ``<think>`` blocks, are refused: the ids the policy saw would differ from any render of the conversation),
and the ids of a probe conversation built turn by turn (prompt, each assistant turn as the template renders it, each
:meth:`ToolTurns.continuation_ids`) must equal the ids of its full render, token for token.
"""

from __future__ import annotations

from llmtune.config import RecipeError
from llmtune.data.templates import PROBE_TOOL, TOOL_TEMPLATE_FIX, tool_probe_conversation, tool_render_problem

def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


class ToolTurns:
    """The template's token ids between an assistant turn and the next one (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer with its chat template. tools: the JSON schemas of the run's tools (as
            ``apply_chat_template(tools=...)`` takes them). stop_token_ids: the run's stop set (the end-of-turn
            token that closes a sampled assistant turn is one of them).

    Raises:
        RecipeError: the template cannot render a tool conversation, or an assistant turn it renders does not end
            with one of the stop tokens (``data.chat_template``).
    """

    def __init__(self, tokenizer, tools: list[dict], stop_token_ids):
        self.tokenizer, self.tools = tokenizer, [*tools, PROBE_TOOL]
        self.stop_texts = [t for t in tokenizer.convert_ids_to_tokens(list(stop_token_ids)) if t]
        base = self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
        self.tail = base[self.turn_end(base, base.rfind("Hello")):]  # the template's text after the end of turn
        self._anchor = [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "", "tool_calls": [_call("probe_tool", {"x": "a"})]}]
        self._anchor_text = self.render(self._anchor)

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        """``messages`` (with the run's tools) as the chat template renders them.

        Raises:
            RecipeError: the template fails on a tool conversation (``data.chat_template``).
        """
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception() in templates
            raise RecipeError([("data.chat_template", f"the chat template cannot render a conversation with tools "
                                f"({type(exc).__name__}: {exc}); {TOOL_TEMPLATE_FIX}")]) from None

    def turn_end(self, text: str, start: int = 0) -> int:
        """Index just past the first stop token's text at or after ``start`` in ``text`` (the end of an assistant
        turn as the template renders it).

        Raises:
            RecipeError: there is none: the template does not end assistant turns with a stop token.
        """
        hits = [text.find(stop, max(start, 0)) for stop in self.stop_texts]
        hits = [(at, len(stop)) for at, stop in zip(hits, self.stop_texts) if at >= 0]
        if start < 0 or not hits:
            raise RecipeError([("data.chat_template", f"the chat template does not end an assistant turn with one of "
                                f"the stop tokens {self.stop_texts}: a sampled turn could never end where the template "
                                f"ends it; {TOOL_TEMPLATE_FIX}")])
        at, length = min(hits)
        return at + length

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def continuation_ids(self, tool_messages: list[dict]) -> list[int]:
        """The ids to append after an assistant turn that ended on its stop token: the template's text after the
        end-of-turn token, ``tool_messages`` (``{"role": "tool", "name", "content"}``) as the template renders them,
        and the next assistant header (the generation prompt).

        Raises:
            RecipeError: the template renders earlier turns differently once tool messages follow (it rewrites
                history).
        """
        full = self.render(self._anchor + tool_messages, generation_prompt=True)
        if not full.startswith(self._anchor_text):
            raise RecipeError([("data.chat_template", "the chat template renders an assistant turn differently once "
                                f"tool results follow it (it rewrites history); {TOOL_TEMPLATE_FIX}")])
        return self.encode(self.tail + full[len(self._anchor_text):])


def check_tool_template(tokenizer, tools: list[dict], stop_token_ids, render_ids) -> ToolTurns:
    """Check that multi-turn rollouts with this template give the ids of a full render, and return the
    :class:`ToolTurns` of the run (see the module docstring for what is checked).

    Args:
        tokenizer: the policy's tokenizer (``data.chat_template`` applied). tools: the run's tool schemas.
        stop_token_ids: the run's stop set. render_ids: ``fn(messages, tools, generation_prompt) -> ids``, a
            conversation's ids exactly as the run renders prompts (:func:`llmtune.data.prompts.prompt_ids`: the
            template's text, one BOS where the tokenizer adds one).

    Raises:
        RecipeError: naming ``data.chat_template`` and the fix: the template drops tool schemas, tool calls or tool
            results; rewrites earlier turns; does not end turns with a stop token; or its turn-by-turn ids differ
            from its full render (the first differing token and its neighbourhood are shown).
    """
    problem = tool_render_problem(tokenizer)
    if problem:
        raise RecipeError([("data.chat_template", f"{problem} (multi-turn rollouts with tools need the tool schemas, "
                            f"the tool calls and the tool results); {TOOL_TEMPLATE_FIX}")])
    turns = ToolTurns(tokenizer, tools, stop_token_ids)
    conversation = tool_probe_conversation()
    ids: list[int] = list(render_ids(conversation[:1], turns.tools, True))
    i = 1
    while i < len(conversation):
        if conversation[i]["role"] == "assistant":
            before = turns.render(conversation[:i], generation_prompt=True)
            through = turns.render(conversation[:i + 1])
            if not through.startswith(before):
                raise RecipeError([("data.chat_template", "the chat template renders an earlier turn differently once "
                                    "later turns follow (it rewrites history, e.g. strips earlier <think> blocks): the "
                                    "ids the policy saw would differ from any render of the conversation; "
                                    f"{TOOL_TEMPLATE_FIX}")])
            turn = through[len(before):]
            ids += turns.encode(turn[:turns.turn_end(turn)])  # the turn as a policy would sample it, stop included
            i += 1
        else:
            j = i
            while j < len(conversation) and conversation[j]["role"] == "tool":
                j += 1
            ids += turns.continuation_ids(conversation[i:j])
            i = j
    ids += turns.encode(turns.tail)
    want = list(render_ids(conversation, turns.tools, False))
    if ids != want:
        at = next((k for k, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
        shown = tokenizer.decode(want[max(0, at - 8):at + 8])
        raise RecipeError([("data.chat_template", f"turn by turn, the template's ids differ from its full render at "
                            f"token {at} (near {shown!r}): the template either renders the junction between an "
                            "assistant turn and the tool results differently, or rewrites history (e.g. strips earlier "
                            "<think> blocks once later turns follow), so the ids the policy saw would not be what the "
                            f"model sees at inference; {TOOL_TEMPLATE_FIX}")])
    return turns
