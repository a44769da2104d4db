"""The Ollama Modelfile's template (llmtune/export/modelfile.py), without llama.cpp: the turn format read off a Jinja
chat template, the Go template written from it, the Go-template renderer that checks it (against hand-computed
outputs, and against Go's own text/template when a ``go`` toolchain is on PATH), and the Modelfile round trip."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from llmtune.export import modelfile as mf
from llmtune.models.tiny import make_tiny_tokenizer

GEMMA3 = (  # Gemma 3's template (system folded into the first user turn, "model" role), as published
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if "
    "loop.first else \"\") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)
SMOLLM2 = (  # SmolLM2-Instruct's: a default system turn when the conversation has none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizers():
    chatml = make_tiny_tokenizer()
    smol = make_tiny_tokenizer()
    smol.chat_template = SMOLLM2
    gemma = make_tiny_tokenizer(template="llama2", add_bos=True)
    gemma.chat_template = GEMMA3
    return {"chatml": chatml, "llama2_bos": make_tiny_tokenizer(template="llama2", add_bos=True),
            "llama2": make_tiny_tokenizer(template="llama2"), "smollm2": smol, "gemma3": gemma}


def _data(conv):
    return {"Messages": [{"Role": m["role"], "Content": m["content"]} for m in conv]}


@pytest.mark.parametrize("name", list(tokenizers()))
def test_go_template_renders_the_hf_template(name):
    tok = tokenizers()[name]
    fmt = mf.turn_format(tok)
    template = mf.go_template(fmt)
    for conv in mf.check_conversations():
        gen = conv[-1]["role"] != "assistant"
        want = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
        # the BOS text the tokenizer adds by itself is left out of the Ollama template (Ollama's runner adds it)
        assert fmt.bos_dropped + mf.render_go_template(template, _data(conv)) == want


def test_turn_formats_read_off_the_templates():
    toks = tokenizers()
    smol = mf.turn_format(toks["smollm2"])
    assert smol.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert smol.prefix["user"] == "<|im_start|>user\n" and smol.suffix["user"] == "<|im_end|>\n"
    gemma = mf.turn_format(toks["gemma3"])
    assert (gemma.system, gemma.separator, gemma.bos_dropped) == ("first_user", "\n\n", "<s>")
    assert gemma.prefix["assistant"] == "<start_of_turn>model\n"
    assert mf.turn_format(toks["llama2_bos"]).bos_dropped == "<s>" and mf.turn_format(toks["llama2"]).header == "<s>"


def test_position_dependent_template_is_refused_with_the_conversation():
    tok = make_tiny_tokenizer()
    tok.chat_template = (  # the last assistant turn without its end-of-turn token (as Qwen3 strips think blocks)
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
        "{% if not (loop.last and m['role'] == 'assistant') %}{{ '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(mf.TemplateNotExpressible, match="not a fixed turn format.*conversation"):
        mf.turn_format(tok)
    tok.chat_template = None
    with pytest.raises(mf.TemplateNotExpressible, match="no chat template"):
        mf.turn_format(tok)


def test_renderer_on_ollama_style_templates():
    """Hand-computed Go text/template results (trim markers, range with index, variables, else-if, and/or/not)."""
    data = {"Messages": [{"Role": "system", "Content": "S"}, {"Role": "user", "Content": "U"}], "System": ""}
    t = ('{{- range $i, $m := .Messages }}\n{{- if eq $m.Role "system" }}<sys>{{ .Content }}</sys>\n'
         '{{- else if eq .Role "user" }}<u>{{ $m.Content }}</u>{{ end }}\n{{- end }}\n{{ if not .System }}!{{ end }}')
    assert mf.render_go_template(t, data) == "<sys>S</sys><u>U</u>\n!"
    t = '{{ $x := "a" }}{{ range .Messages }}{{ $x = .Role }}{{ end }}{{ $x }} {{ len .Messages }} {{ or "" "b" }}'
    assert mf.render_go_template(t, data) == "user 2 b"
    t = '{{ range $i, $_ := .Messages }}{{ if eq (len (slice $.Messages $i)) 1 }}last={{ $i }}{{ end }}{{ end }}'
    assert mf.render_go_template(t, data) == "last=1"
    with pytest.raises(ValueError, match="unclosed block"):
        mf.render_go_template("{{ if true }}x", data)


def test_modelfile_round_trip():
    template = mf.go_template(mf.turn_format(make_tiny_tokenizer()))
    text = mf.modelfile_text("model-q4_k_m.gguf", template, ["<|im_end|>", '"quoted"'], ["model-f16.gguf"])
    spec = mf.parse_modelfile(text)
    assert spec["from"] == "./model-q4_k_m.gguf" and spec["template"] == template
    assert spec["parameters"] == [("stop", "<|im_end|>"), ("stop", '"quoted"')]
    assert "./model-f16.gguf" in text


@pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain on PATH (optional cross-check)")
def test_renderer_agrees_with_go_text_template(tmp_path):
    """Go's own text/template renders the written templates exactly as the Python renderer does."""
    (tmp_path / "go.mod").write_text("module render\ngo 1.19\n")
    (tmp_path / "main.go").write_text(
        'package main\nimport ("encoding/json"; "os"; "text/template")\n'
        "type Message struct { Role string; Content string }\n"
        "func main() { tb, _ := os.ReadFile(os.Args[1]); db, _ := os.ReadFile(os.Args[2])\n"
        "  var data struct{ Messages []Message }; if err := json.Unmarshal(db, &data); err != nil { panic(err) }\n"
        '  t := template.Must(template.New("t").Parse(string(tb))); if err := t.Execute(os.Stdout, data); err != nil '
        "{ panic(err) } }\n")
    subprocess.run(["go", "build", "-o", "render", "."], cwd=tmp_path, check=True, capture_output=True,
                   env={**__import__("os").environ, "GOFLAGS": "-mod=mod", "GOCACHE": str(tmp_path / "cache")})
    for tok in tokenizers().values():
        template = mf.go_template(mf.turn_format(tok))
        (tmp_path / "t.tmpl").write_text(template)
        for conv in mf.check_conversations() + [[{"role": "user", "content": 'x {{ .Role }} " \\ y'}]]:
            (tmp_path / "d.json").write_text(json.dumps(_data(conv)))
            go = subprocess.run([str(tmp_path / "render"), str(tmp_path / "t.tmpl"), str(tmp_path / "d.json")],
                                capture_output=True, text=True, check=True).stdout
            assert go == mf.render_go_template(template, _data(conv))
