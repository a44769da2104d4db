"""Chat templates: the builtin ones, :func:`apply_chat_template_config` and the tool-capability check.

Every builtin template renders each assistant turn followed by its end-of-turn token (``<|im_end|>``,
``<|eot_id|>`` or the tokenizer's EOS), and renders ``messages[:i]`` with ``add_generation_prompt=True``
as an exact prefix of the full conversation, which the loss masking in :mod:`llmtune.data.tokenize`
relies on ("prefix-consistent").
"""

from __future__ import annotations

from llmtune.config.schema import DataConfig
from llmtune.data.errors import DataError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-2-chat as published by Meta/HF: "<s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s>".
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

ALPACA = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n### Response:\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + '\n\n' }}{% endif %}"
    "{% endfor %}"
)

ZEPHYR = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# ChatML with tools in the Hermes / Qwen2.5 format: the tool schemas in the system turn (after the system message, if
# any), an assistant turn's tool calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks after its
# text, consecutive tool results in one user turn as <tool_response> blocks. Without tools and tool messages it
# renders exactly as `chatml`. Multi-turn agent rollouts (agent:) use it with models whose own template has no tools.
CHATML_TOOLS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set call = call['function'] if call.get('function') else call %}"
    "{%- if (message['content'] or '') or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML,
    "chatml_tools": CHATML_TOOLS,
    "llama2": LLAMA2,
    "llama3": LLAMA3,
    "alpaca": ALPACA,
    "zephyr": ZEPHYR,
}


def resolve_chat_template(spec: str) -> str:
    """Turn ``data.chat_template`` into Jinja source.

    Args:
        spec: a builtin name (``chatml``, ``chatml_tools``, ``llama2``, ``llama3``, ``alpaca``, ``zephyr``) or a Jinja
            string.

    Returns:
        The Jinja source.

    Raises:
        DataError: ``spec`` is neither a builtin name nor Jinja (no ``{{`` or ``{%``).
    """
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    if "{{" in spec or "{%" in spec:
        return spec
    raise DataError(
        f"data.chat_template: {spec!r} is not a builtin template ({', '.join(BUILTIN_TEMPLATES)}) and does not "
        "look like Jinja (no '{{' or '{%'). Use a builtin name, a Jinja string, or null for the tokenizer's own."
    )


def apply_chat_template_config(cfg: DataConfig, tokenizer) -> None:
    """Set ``tokenizer.chat_template`` from ``cfg.chat_template`` (in place).

    ``None`` keeps the tokenizer's own template. The template set here is the one the adapter is saved
    with, so training and inference render conversations the same way.

    Args:
        cfg: the recipe's ``data`` section.
        tokenizer: a Hugging Face tokenizer; modified in place.

    Raises:
        DataError: ``cfg.chat_template`` is not a builtin name or Jinja, or it is null and the tokenizer
            has no chat template.
    """
    if cfg.chat_template is None:
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise DataError(
                f"the tokenizer {name!r} has no chat template, and data.chat_template is not set. "
                f"Set data.chat_template to a builtin ({', '.join(BUILTIN_TEMPLATES)}) or a Jinja string."
            )
    else:
        tokenizer.chat_template = resolve_chat_template(cfg.chat_template)
    check_chat_template(tokenizer, "data.chat_template" if cfg.chat_template else "the tokenizer's chat template")


def check_chat_template(tokenizer, where: str) -> None:
    """Render a two-turn conversation once, so a broken template is one configuration error, not a bad
    row per conversation; warn when an assistant turn does not end with the tokenizer's EOS (the model
    would never learn to stop).

    Raises:
        DataError: the template does not compile or fails to render a plain user/assistant exchange.
    """
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        prompt = tokenizer.apply_chat_template(probe[:1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception as exc:  # jinja2 syntax/undefined errors, raise_exception() in templates
        raise DataError(f"{where} does not render a user/assistant exchange: {type(exc).__name__}: {exc}. "
                        f"Fix the Jinja, or use a builtin ({', '.join(BUILTIN_TEMPLATES)}).") from None
    turn = full[len(prompt):].rstrip() if full.startswith(prompt) else full
    eos = tokenizer.eos_token
    if eos and not turn.endswith(eos):
        import logging

        logging.getLogger("llmtune.data").warning(
            "%s: an assistant turn renders as %r, which does not end with the EOS token %r; the model will not learn "
            "to stop. Use a template that closes assistant turns with the EOS.", where, turn[-40:], eos)


# The tool-capability probe (SFT tool conversations check it before tokenizing; multi-turn rollouts can use it too):
# a two-round tool conversation with several calls in one turn, text before a call and an empty-content call turn.
PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool", "description": "A probe tool.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "A value."}},
                   "required": ["x"]}}}
TOOL_TEMPLATE_FIX = ("set data.chat_template to a template that renders tools, tool calls and tool results, e.g. "
                     "data.chat_template: chatml_tools (ChatML with Hermes/Qwen2.5 <tool_call> blocks), or the model "
                     "family's own tool template")


def _probe_call(x: str, name: str = "probe_tool") -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"x": x}}}


def tool_probe_conversation() -> list[dict]:
    """A two-round tool conversation (several calls in one turn, text with a think block before a call, a call turn
    without text, a final answer) that :func:`tool_render_problem` renders with :data:`PROBE_TOOL` (the think block
    lets a caller catch templates that rewrite history, e.g. strip earlier ``<think>`` blocks)."""
    return [
        {"role": "user", "content": "What is 12 * 7 + 3?"},
        {"role": "assistant", "content": "<think>\nfirst the product\n</think>\n\nLet me compute.",
         "tool_calls": [_probe_call("12 * 7"), _probe_call("84 + 3")]},
        {"role": "tool", "name": "probe_tool", "content": "eighty-four"},
        {"role": "tool", "name": "probe_tool", "content": "eighty-seven"},
        {"role": "assistant", "content": "", "tool_calls": [_probe_call("check 87")]},
        {"role": "tool", "name": "probe_tool", "content": "checked"},
        {"role": "assistant", "content": "The answer is 87. #### 87"},
    ]


def tool_render_problem(tokenizer) -> str | None:
    """What the tokenizer's chat template fails to render of a tool conversation, or None when it renders the tool
    schemas (passed as ``tools=``), the assistant's tool calls and the tool results (:func:`tool_probe_conversation`).

    Many templates cannot: they drop ``tools`` and ``tool_calls`` silently and render a ``tool`` turn as an unknown
    role, so the model would be trained on conversations that lack what it should learn.

    Returns:
        A sentence naming what is missing (or the template's error), for the caller's error with
        :data:`TOOL_TEMPLATE_FIX`; None when the template is capable.
    """
    try:
        text = tokenizer.apply_chat_template(tool_probe_conversation(), tools=[PROBE_TOOL], tokenize=False)
        missing = [what for what, needle in (("the tool schemas", PROBE_TOOL["function"]["description"]),
                                             ("the tool calls", "check 87"), ("the tool results", "eighty-four"))
                   if needle not in text]
        if "the tool calls" not in missing and not _call_names_survive(tokenizer):
            missing.append("the names of the called tools")
    except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception() in templates
        return f"the chat template cannot render a conversation with tools ({type(exc).__name__}: {exc})"
    listed = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
    return f"the chat template does not render {listed}" if missing else None


def _call_names_survive(tokenizer) -> bool:
    """Whether the called tool's name is rendered in the call itself: the probe conversation with its last call
    renamed (the schemas of both names given in both renders, the tool results unchanged) must render with one more
    occurrence of the new name. A template that writes only a call's arguments passes the arguments check but leaves
    the model unable to tell which tool it called. Template errors propagate (the caller reports them)."""
    other = "probe_lookup"
    tools = [PROBE_TOOL, {**PROBE_TOOL, "function": {**PROBE_TOOL["function"], "name": other}}]
    renamed = tool_probe_conversation()
    renamed[4] = {**renamed[4], "tool_calls": [_probe_call("check 87", other)]}
    counts = [tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False).count(other)
              for conversation in (tool_probe_conversation(), renamed)]
    return counts[1] > counts[0]


def check_tool_rendering(tokenizer, where: str, rows: str) -> None:
    """Refuse a chat template that cannot render tool conversations (:func:`tool_render_problem`), once, before any
    row is tokenized.

    Args:
        where: the template's origin for the message (``data.chat_template`` or the tokenizer's own).
        rows: which data has tool conversations (e.g. ``"12 rows of data.datasets[0] (x.jsonl)"``).

    Raises:
        DataError: naming the template, what it drops, the rows and the fix.
    """
    problem = tool_render_problem(tokenizer)
    if problem:
        raise DataError(f"{where}: {problem}, and {rows} are tool conversations (tool calls, tool results or a tools "
                        f"column); {TOOL_TEMPLATE_FIX}.")


def template_eos_ids(tokenizer) -> list[int]:
    """Token ids that end a reply: the tokenizer's EOS and the special token that closes an assistant turn in the
    chat template (``<|eot_id|>`` of Llama-3, ``<|im_end|>`` of ChatML), which is not always the tokenizer's EOS.

    Found by rendering a user/assistant exchange and taking the first special token after the assistant's text.
    Used wherever a reply is generated (PPO rollouts, on-policy pairs, chat) and in the exported generation config.

    Returns:
        Sorted ids; empty only when the tokenizer has no EOS and its template closes turns with no special token.
    """
    ids = {tokenizer.eos_token_id} - {None}
    if getattr(tokenizer, "chat_template", None):
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot render a plain exchange has no turn end to find
            text = ""
        cut = text.rfind("Hello there")
        if cut >= 0:
            special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
            tail = tokenizer(text[cut + len("Hello there"):], add_special_tokens=False)["input_ids"]
            ids |= set([i for i in tail if i in special][:1])
    return sorted(ids)


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """THE set of token ids that end a generated reply, computed once and used everywhere a reply is sampled or cut:
    the tokenizer's EOS and the template's end of turn (:func:`template_eos_ids`) plus every ``eos_token_id`` of the
    model's generation config (``generation_config.json``; Qwen2.5-Instruct lists ``<|im_end|>`` and
    ``<|endoftext|>``, Llama-3.1-Instruct ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``).

    Engines are given this set explicitly and nothing else: transformers' ``generate(eos_token_id=...)`` and vLLM's
    ``stop_token_ids`` with ``ignore_eos`` (vLLM would otherwise merge the generation config's EOS list into every
    request on its own, and the trainer would read the padding after such a stop as sampled tokens). The completion
    split (``llmtune.rl.engines.hf.cut_completions``, the vLLM engine's answer check), the on-policy pairs step and ``llmtune chat`` use the same set.

    Args:
        tokenizer: the policy's tokenizer (with its chat template).
        generation_config: a ``transformers.GenerationConfig`` (or anything with ``eos_token_id``: an int, a list,
            None), usually ``model.generation_config``; None = the tokenizer and template only.

    Returns:
        Sorted ids; empty only when none of the three defines one.
    """
    configured = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    configured = [configured] if isinstance(configured, int) else list(configured or [])
    return sorted({*template_eos_ids(tokenizer), *(int(i) for i in configured if i is not None)})


def _probe_conversations() -> list[list[dict]]:
    user, answer = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}
    return [[{"role": "system", "content": "Be brief."}, user, answer], [user, answer]]


def turn_tail_ids(tokenizer) -> list[int]:
    """Token ids the chat template renders after the end-of-turn token that closes the last assistant turn:
    ChatML ``"\\n"`` after ``<|im_end|>``, alpaca ``"\\n\\n"``; none for Llama-2/3 (the turn ends the text).

    A reward model is trained on the template's exact output (:func:`llmtune.data.preference.render_turn`), so a
    generated reply that stops at its end-of-turn token gets these ids appended before it is scored (:meth:`llmtune.models.reward.RewardModel.score_rollouts`).

    Returns:
        The ids (empty without a chat template or when nothing follows the end-of-turn token).
    """
    if not getattr(tokenizer, "chat_template", None):
        return []
    ends = set(template_eos_ids(tokenizer))
    for probe in _probe_conversations():
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # noqa: BLE001 - e.g. a template that refuses a system message: try the next probe
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        last = max((i for i, t in enumerate(ids) if t in ends), default=None)
        return [] if last is None else ids[last + 1:]
    return []


def dedicated_pad_token(tokenizer, vocab_rows: int | None = None) -> str | None:
    """A pad token that never occurs in a chat sequence, for reward models used outside llmtune.

    transformers' ``*ForSequenceClassification`` reads the score at the last token that is not
    ``config.pad_token_id``. When pad == EOS (SmolLM2; Llama set-ups that reuse EOS) a sequence that ends with EOS
    is read one token early (up to 1.87 off on SmolLM2). A token the chat template never renders and the tokenizer
    never produces from text makes that rule read the last real token, padded or not.

    Candidates, first fitting wins: the tokenizer's own pad token, its unk token, then its other special/added
    tokens by id; a candidate fits when it is none of EOS, BOS, the end-of-turn tokens and the special tokens a
    rendered system/user/assistant conversation (with the generation prompt) contains, and its id is below
    ``vocab_rows`` (the model's embedding rows, when given).

    Returns:
        The token text, or ``None`` when no token fits (the caller then adds one).
    """
    used = set(template_eos_ids(tokenizer)) | {tokenizer.eos_token_id, tokenizer.bos_token_id}
    if getattr(tokenizer, "chat_template", None):
        for probe in _probe_conversations():
            for generation_prompt in (False, True):
                try:
                    text = tokenizer.apply_chat_template(probe[:-1] if generation_prompt else probe, tokenize=False,
                                                         add_generation_prompt=generation_prompt)
                except Exception:  # noqa: BLE001 - templates that refuse a system message
                    continue
                used |= set(tokenizer(text, add_special_tokens=False)["input_ids"])
    added = sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())
    candidates = [tokenizer.pad_token, tokenizer.unk_token, *(t.content for _, t in added if t.special)]
    for token in candidates:
        if token is None:
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id in used or (vocab_rows is not None and token_id >= vocab_rows):
            continue
        if tokenizer(token, add_special_tokens=False)["input_ids"] != [token_id]:
            continue  # not atomic in text: not a real special token
        return token
    return None
