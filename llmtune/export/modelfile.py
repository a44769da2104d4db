"""The Ollama ``Modelfile`` of a GGUF export: the chat template as a Go template, and the stop tokens.

Ollama does not run Jinja: its ``TEMPLATE`` is a Go ``text/template`` over ``.Messages`` (each with ``.Role`` and
``.Content``). A Jinja chat template is a program; what Ollama needs is its *turn format*, found here by rendering
the HF template on probe conversations with sentinel contents (:func:`turn_format`):

    header + for each message: prefix[role] + content + suffix[role] + (generation prompt after a last non-assistant)

with the system message a turn of its own (ChatML, Llama 3), one with a default content when the conversation brings
none (SmolLM2, Qwen2.5), or folded into the first user turn (Gemma). The format is accepted only if it reproduces the
HF template exactly on every check conversation (system or not, one or several turns, ending with a user or an
assistant message); a template that depends on more than that (Qwen3's, which renders the last assistant turn
differently from earlier ones) is refused with the first conversation it renders differently (:class:`TemplateNotExpressible`). The Go template is
then emitted from the format (every literal a quoted Go string, so layout whitespace cannot leak into the prompt)
and checked again by rendering it with :func:`render_go_template`, a small interpreter of the Go ``text/template``
subset written here (range, if/else if, eq/ne/and/or/not, len, slice, variables), against the HF template.

BOS: Ollama's llama.cpp runner tokenizes the rendered prompt adding BOS when the GGUF says so; a template that
renders the BOS text itself (Llama 2, Gemma) would then start with two, so the header drops that text when the
tokenizer adds BOS on its own (what ``apply_chat_template`` tokenizes is then the same ids).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from llmtune.errors import LlmtuneError

_S, _U, _U2, _A, _A2 = "SYSTEMxq7", "USERxq7", "USERTWOxq7", "ASSISTANTxq7", "ASSISTANTTWOxq7"


class TemplateNotExpressible(LlmtuneError, ValueError):
    """The chat template cannot be written as an Ollama Go template that renders the same prompts."""


@dataclass
class TurnFormat:
    """A chat template as header + per-role prefix/suffix + generation prompt (module docstring)."""

    header: str
    prefix: dict[str, str]
    suffix: dict[str, str]
    generation: str
    system: str = "turn"  # "turn": a turn of its own; "first_user": content + separator before the first user's
    separator: str = ""
    bos_dropped: str = ""  # BOS text removed from the header (the tokenizer adds BOS itself)
    default_system: str | None = None  # a system turn rendered when the conversation does not start with one
    roles: tuple[str, ...] = field(default=("system", "user", "assistant"))

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """What the format renders (the header with any dropped BOS text restored: the HF template's text)."""
        out = [self.bos_dropped + self.header]
        if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
            out.append(self.prefix["system"] + self.default_system + self.suffix["system"])
        system = next((m["content"] for m in messages if m["role"] == "system"), None) \
            if self.system == "first_user" else None
        first = True
        for m in messages:
            role, content = m["role"], m["content"]
            if role == "system" and self.system == "first_user":
                continue
            if role == "user" and first and system:
                content = system + self.separator + content
            first = first and role != "user"
            out.append(self.prefix[role] + content + self.suffix[role])
        if add_generation_prompt and messages and messages[-1]["role"] != "assistant":
            out.append(self.generation)
        return "".join(out)


def check_conversations() -> list[list[dict]]:
    """The conversations a turn format (and the Modelfile's template) must render exactly as the HF template."""
    s = {"role": "system", "content": "You are a careful assistant.\nAnswer briefly."}
    u1 = {"role": "user", "content": "What is 12 * 7?"}
    a1 = {"role": "assistant", "content": "12 * 7 = 84."}
    u2 = {"role": "user", "content": "And 84 / 2?  Show\nyour work."}
    a2 = {"role": "assistant", "content": "84 / 2 = 42."}
    return [[u1], [s, u1], [u1, a1, u2], [s, u1, a1, u2], [u1, a1], [s, u1, a1, u2, a2]]


def _render(tokenizer, messages, gen: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def turn_format(tokenizer) -> TurnFormat:
    """The turn format of the tokenizer's chat template (module docstring).

    Raises:
        TemplateNotExpressible: no template, a template that fails on plain conversations, or one that renders a
            check conversation differently from any turn format (names that conversation and both texts).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateNotExpressible("the tokenizer has no chat template, so there is no TEMPLATE to write")
    u, a, u2 = {"role": "user", "content": _U}, {"role": "assistant", "content": _A}, {"role": "user", "content": _U2}
    try:
        one = _render(tokenizer, [u], False)
        gen = _render(tokenizer, [u], True)
        three = _render(tokenizer, [u, a, u2], False)
    except Exception as err:  # noqa: BLE001 - any Jinja error: the template cannot render a plain exchange
        raise TemplateNotExpressible(f"the chat template fails on a plain user/assistant exchange: {err}") from None
    if not gen.startswith(one) or _U not in one or _A not in three or _U2 not in three:
        raise TemplateNotExpressible("the chat template's generation prompt is not an addition at the end, or it "
                                     "drops message contents")
    if not three.startswith(one):
        raise TemplateNotExpressible("the chat template renders a first user turn differently once a reply follows")
    suf_u = one[one.index(_U) + len(_U):]
    head_and_pre_u = one[:one.index(_U)]  # header + user prefix
    pre_a = three[len(one):three.index(_A)]
    after_a = three[three.index(_A) + len(_A):three.index(_U2)]  # assistant suffix + user prefix
    k = 0  # the user prefix is a common end of both; which cut is right shows in the check renders
    while k < min(len(after_a), len(head_and_pre_u)) and after_a[-1 - k] == head_and_pre_u[-1 - k]:
        k += 1
    cuts = sorted(range(k + 1), key=lambda c: (head_and_pre_u[:len(head_and_pre_u) - c]
                                               not in ("", getattr(tokenizer, "bos_token", None) or ""), -c))
    candidates = [(head_and_pre_u[:len(head_and_pre_u) - c], head_and_pre_u[len(head_and_pre_u) - c:],
                   after_a[:len(after_a) - c]) for c in cuts]
    problems = []
    for header, pre_u, suf_a in candidates:
        for fmt in _system_variants(tokenizer, header, pre_u, suf_u, pre_a, suf_a, gen[len(one):]):
            problem = _first_difference(tokenizer, fmt)
            if problem is None:
                return _drop_bos(fmt, tokenizer)
            problems.append(problem)
    raise TemplateNotExpressible(
        "the chat template is not a fixed turn format (header + per-role prefix/suffix + generation prompt): "
        + (problems[0] if problems else "no consistent split of its turns"))


def _system_variants(tokenizer, header, pre_u, suf_u, pre_a, suf_a, generation):
    base = dict(header=header, prefix={"user": pre_u, "assistant": pre_a}, suffix={"user": suf_u, "assistant": suf_a},
                generation=generation)
    try:
        with_system = _render(tokenizer, [{"role": "system", "content": _S}, {"role": "user", "content": _U}], False)
    except Exception:  # noqa: BLE001 - templates that refuse a system message (some Mistral/Gemma 2 versions)
        with_system = None
    if with_system is None or _S not in with_system:
        yield TurnFormat(**{**base, "prefix": {**base["prefix"], "system": ""}, "suffix": {**base["suffix"], "system": ""}},
                         roles=("user", "assistant"))
        return
    i_s, i_u = with_system.index(_S), with_system.index(_U)
    if i_s > i_u:
        return
    between = with_system[i_s + len(_S):i_u]
    suf_s = between[:len(between) - len(pre_u)] if between.endswith(pre_u) else None
    if with_system.startswith(header) and suf_s is not None:  # system: a turn of its own
        yield TurnFormat(**{**base, "prefix": {**base["prefix"], "system": with_system[len(header):i_s]},
                            "suffix": {**base["suffix"], "system": suf_s}})
    pre_s_all = with_system[:i_s]  # a default system turn when none is given (SmolLM2, Qwen2.5)
    if suf_s is not None and header.startswith(pre_s_all) and header.endswith(suf_s) and \
            len(header) >= len(pre_s_all) + len(suf_s):
        yield TurnFormat(**{**base, "header": "", "prefix": {**base["prefix"], "system": pre_s_all},
                            "suffix": {**base["suffix"], "system": suf_s}},
                         default_system=header[len(pre_s_all):len(header) - len(suf_s)])
    if with_system.startswith(header + pre_u + _S):  # system folded into the first user turn (Gemma)
        yield TurnFormat(**{**base, "prefix": {**base["prefix"], "system": ""},
                            "suffix": {**base["suffix"], "system": ""}}, system="first_user", separator=between)


def _first_difference(tokenizer, fmt: TurnFormat) -> str | None:
    for conv in check_conversations():
        if "system" not in fmt.roles and any(m["role"] == "system" for m in conv):
            continue
        for gen in (True, False):
            if gen and conv[-1]["role"] == "assistant":
                continue
            want = _render(tokenizer, conv, gen)
            got = fmt.render(conv, gen)
            if want != got:
                roles = "/".join(m["role"] for m in conv)
                return (f"for a {roles} conversation (add_generation_prompt={gen}) the template renders "
                        f"{want!r}, a turn format {got!r}")
    return None


def _drop_bos(fmt: TurnFormat, tokenizer) -> TurnFormat:
    bos = getattr(tokenizer, "bos_token", None)
    adds_bos = bos is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    if adds_bos and fmt.header.startswith(bos):
        fmt.header, fmt.bos_dropped = fmt.header[len(bos):], bos
    return fmt


# ---- the Go template ------------------------------------------------------------------------------------------

def _go(s: str) -> str:
    """A Go interpreted string literal (JSON's escapes are a subset of Go's)."""
    return json.dumps(s, ensure_ascii=False)


def go_template(fmt: TurnFormat) -> str:
    """The Ollama ``TEMPLATE`` of a turn format; literals are quoted Go strings, layout is trimmed with ``{{-``."""
    lines = []
    if fmt.system == "first_user":
        lines += ['{{- $system := "" }}', '{{- range .Messages }}{{ if eq .Role "system" }}{{ $system = .Content }}'
                  '{{ end }}{{ end }}', "{{- $first := true }}"]
    lines += ["{{- range $i, $m := .Messages }}", "{{- $last := eq (len (slice $.Messages $i)) 1 }}"]
    if fmt.header:
        lines.append(f"{{{{- if eq $i 0 }}}}{{{{ {_go(fmt.header)} }}}}{{{{ end }}}}")
    if fmt.default_system is not None:
        lines.append(f'{{{{- if and (eq $i 0) (ne $m.Role "system") }}}}{{{{ {_go(fmt.prefix["system"])} }}}}'
                     f'{{{{ {_go(fmt.default_system)} }}}}{{{{ {_go(fmt.suffix["system"])} }}}}{{{{ end }}}}')
    branch = "if"
    for role in ("system", "user", "assistant"):
        if role == "system" and fmt.system == "first_user":
            continue
        if role not in fmt.roles:
            continue
        content = "{{ $m.Content }}"
        if role == "user" and fmt.system == "first_user":
            content = (f"{{{{ if and $first $system }}}}{{{{ $system }}}}{{{{ {_go(fmt.separator)} }}}}{{{{ end }}}}"
                       "{{ $m.Content }}{{ $first = false }}")
        lines.append(f'{{{{- {branch} eq $m.Role "{role}" }}}}{{{{ {_go(fmt.prefix[role])} }}}}{content}'
                     f"{{{{ {_go(fmt.suffix[role])} }}}}")
        branch = "else if"
    lines.append("{{- end }}")
    if fmt.generation:
        lines.append(f'{{{{- if and $last (ne $m.Role "assistant") }}}}{{{{ {_go(fmt.generation)} }}}}{{{{ end }}}}')
    lines.append("{{- end }}")
    return "\n".join(lines)


def modelfile_text(gguf_name: str, template: str, stops: list[str], other_files: list[str] = ()) -> str:
    """The Modelfile: ``FROM ./<gguf>``, ``TEMPLATE \"\"\"...\"\"\"``, one ``PARAMETER stop`` per stop token text."""
    lines = ["# Ollama: ollama create NAME -f Modelfile   (written by llmtune export --gguf)"]
    if other_files:
        lines.append("# other quantizations beside this file: " + ", ".join(f"./{f}" for f in other_files)
                     + " (change FROM to use one)")
    lines += [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER stop {_go(s)}" for s in stops]
    return "\n".join(lines) + "\n"


def parse_modelfile(text: str) -> dict:
    """``{"from": str, "template": str, "parameters": [(name, value)]}`` of a Modelfile (the subset written here:
    one-line instructions and a triple-quoted TEMPLATE; quoted parameter values are unquoted)."""
    out: dict = {"from": None, "template": None, "parameters": []}
    rest = text
    while rest:
        line, _, rest = rest.partition("\n")
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        word, _, value = stripped.partition(" ")
        word = word.upper()
        if word == "TEMPLATE" and value.startswith('"""'):
            body = value[3:] + "\n" + rest
            end = body.index('"""')
            out["template"], rest = body[:end], body[end + 3:]
        elif word == "FROM":
            out["from"] = value
        elif word == "PARAMETER":
            name, _, val = value.partition(" ")
            out["parameters"].append((name, json.loads(val) if val.startswith('"') else val))
    return out


# ---- a Go text/template interpreter for that subset ----------------------------------------------------------

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\(|\)|:=|=|[^\s()]+')


def _lex(template: str) -> list[tuple[str, str]]:
    """``[("text", s) | ("action", body)]`` with ``{{-``/``-}}`` whitespace trimming applied to the texts."""
    parts, pos = [], 0
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        if parts and parts[-1][0] == "trim_next":
            parts.pop()
            text = text.lstrip(" \t\r\n")
        parts.append(("text", text))
        parts.append(("action", m.group(2)))
        if m.group(3):
            parts.append(("trim_next", ""))
        pos = m.end()
    text = template[pos:]
    if parts and parts[-1][0] == "trim_next":
        parts.pop()
        text = text.lstrip(" \t\r\n")
    parts.append(("text", text))
    return [p for p in parts if p != ("text", "")]


def _parse(parts, i=0, stop=("end",)):
    """Nodes until an action whose first word is in ``stop``; returns (nodes, index of that action, its body)."""
    nodes = []
    while i < len(parts):
        kind, body = parts[i]
        if kind == "text":
            nodes.append(("text", body))
            i += 1
            continue
        word = body.split(None, 1)[0] if body else ""
        if word in stop:
            return nodes, i, body
        if word in ("if", "range"):
            branches, i = _parse_block(parts, i, word)
            nodes.append((word, branches))
            continue
        nodes.append(("expr", body))
        i += 1
    if stop != ():
        raise ValueError(f"unclosed block: expected {{{{ {' / '.join(stop)} }}}}")
    return nodes, i, ""


def _parse_block(parts, i, word):
    """``if``: [(cond, nodes), ..., (None, else_nodes)]; ``range``: [(header, nodes)]."""
    head = parts[i][1][len(word):].strip()
    branches = []
    i += 1
    while True:
        nodes, i, body = _parse(parts, i, stop=("end", "else"))
        branches.append((head, nodes))
        if body.split(None, 1)[0] == "end":
            return branches, i + 1
        rest = body[len("else"):].strip()
        if rest.startswith("if "):
            head = rest[3:].strip()
        else:
            head = None
        i += 1


def render_go_template(template: str, data: dict) -> str:
    """Render ``template`` (Go text/template syntax, the subset :func:`go_template` and Ollama's own templates use)
    with ``data`` (``{"Messages": [{"Role": ..., "Content": ...}], ...}``).

    Raises:
        ValueError: a construct outside the subset.
    """
    nodes, _, _ = _parse(_lex(template), stop=())
    out: list[str] = []
    _exec(nodes, data, [{"$": data}], out)
    return "".join(out)


def _exec(nodes, dot, scopes, out):
    for node in nodes:
        kind = node[0]
        if kind == "text":
            out.append(node[1])
        elif kind == "expr":
            value = _eval_action(node[1], dot, scopes)
            if value is not None:
                out.append(_to_str(value))
        elif kind == "if":
            for cond, body in node[1]:
                if cond is None or _truth(_eval(_tokens(cond), dot, scopes)):
                    scopes.append({})
                    _exec(body, dot, scopes, out)
                    scopes.pop()
                    break
        elif kind == "range":
            head, body = node[1][0]
            names, expr = [], head
            if ":=" in head:
                left, expr = head.split(":=", 1)
                names = [n.strip() for n in left.split(",")]
            seq = _eval(_tokens(expr.strip()), dot, scopes)
            for index, item in enumerate(seq or []):
                scope = {}
                if len(names) == 2:
                    scope[names[0]], scope[names[1]] = index, item
                elif len(names) == 1:
                    scope[names[0]] = item
                scopes.append(scope)
                _exec(body, item, scopes, out)
                scopes.pop()
            if len(node[1]) > 1 and not seq:
                _exec(node[1][1][1], dot, scopes, out)


def _eval_action(body, dot, scopes):
    tokens = _tokens(body)
    if len(tokens) >= 3 and tokens[0].startswith("$") and tokens[1] in (":=", "="):
        value = _eval(tokens[2:], dot, scopes)
        if tokens[1] == ":=":
            scopes[-1][tokens[0]] = value
        else:
            for scope in reversed(scopes):
                if tokens[0] in scope:
                    scope[tokens[0]] = value
                    break
            else:
                raise ValueError(f"undefined variable {tokens[0]}")
        return None
    return _eval(tokens, dot, scopes)


def _tokens(s: str) -> list[str]:
    return _TOKEN.findall(s)


def _eval(tokens, dot, scopes):
    """A pipeline without ``|``: a function call (eq/ne/and/or/not/len/slice/index) or a single operand."""
    args, i = [], 0
    while i < len(tokens):
        t = tokens[i]
        if t == "(":
            depth, j = 1, i + 1
            while depth:
                depth += {"(": 1, ")": -1}.get(tokens[j], 0)
                j += 1
            args.append(("value", _eval(tokens[i + 1:j - 1], dot, scopes)))
            i = j
        else:
            args.append(("word", t))
            i += 1
    if not args:
        raise ValueError("empty action")
    head = args[0]
    funcs = {"eq", "ne", "and", "or", "not", "len", "slice", "index"}
    if head[0] == "word" and head[1] in funcs:
        values = [_operand(a, dot, scopes) for a in args[1:]]
        return _call(head[1], values)
    if len(args) != 1:
        raise ValueError(f"unsupported action: {' '.join(tokens)}")
    return _operand(head, dot, scopes)


def _operand(arg, dot, scopes):
    kind, t = arg
    if kind == "value":
        return t
    if t.startswith('"'):
        return json.loads(t)
    if t in ("true", "false"):
        return t == "true"
    if re.fullmatch(r"-?\d+", t):
        return int(t)
    if t == ".":
        return dot
    if t.startswith("$"):
        name, _, path = t.partition(".")
        for scope in reversed(scopes):
            if name in scope:
                return _field(scope[name], path)
        raise ValueError(f"undefined variable {name}")
    if t.startswith("."):
        return _field(dot, t[1:])
    raise ValueError(f"unsupported operand {t!r}")


def _field(value, path: str):
    for key in filter(None, path.split(".")):
        value = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
    return value


def _truth(v) -> bool:
    return bool(v)  # Go: false, 0, nil, empty string/slice/map are false


def _call(name, args):
    if name == "eq":
        return any(args[0] == other for other in args[1:])
    if name == "ne":
        return args[0] != args[1]
    if name == "and":
        for a in args:
            if not _truth(a):
                return a
        return args[-1]
    if name == "or":
        for a in args:
            if _truth(a):
                return a
        return args[-1]
    if name == "not":
        return not _truth(args[0])
    if name == "len":
        return len(args[0])
    if name == "slice":
        seq = args[0]
        return seq[args[1]:args[2]] if len(args) > 2 else seq[args[1]:]
    if name == "index":
        return args[0][args[1]]
    raise ValueError(f"unsupported function {name}")


def _to_str(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
