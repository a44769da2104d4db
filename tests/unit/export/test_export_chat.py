"""llmtune chat on a run directory (exported or not), a merged directory, and a reward-model run (refused);
replies stop at the chat template's end of turn."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from llmtune.commands.chat import ChatError, generate_reply, load_for_chat
from llmtune.commands.cli import main
from llmtune.export.merge import export_run, load_adapter_model, load_run_recipe
from llmtune.models.tiny import CHATML_TEMPLATE, make_tiny_llama, make_tiny_tokenizer, save_tiny_model
from test_export import lora, write_run

PROMPT = "What is 12 * 7?"


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    base = save_tiny_model(root / "base")
    peft = lora(AutoModelForCausalLM.from_pretrained(base), ["q_proj", "v_proj"], seed=1, scale_b=30)
    return write_run(root / "sft", base, peft, AutoTokenizer.from_pretrained(base))


def test_chat_with_a_run_before_and_after_export_gives_the_adapter_models_reply(sft_run, capsys):
    model, tok, _ = load_adapter_model(sft_run, load_run_recipe(sft_run))
    expected = tok.decode(generate_reply(model.eval(), tok, [{"role": "user", "content": PROMPT}], 6),
                          skip_special_tokens=True).strip()
    assert expected  # six tokens of text from the random model: something to compare
    capsys.readouterr()
    # the reply is the last thing printed (loading logs may come first on stdout)
    assert main(["chat", str(sft_run), "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0  # base + adapter
    assert capsys.readouterr().out.rstrip().endswith(expected)
    export_run(sft_run, dtype="fp32")
    assert load_for_chat(sft_run)[0].config.architectures == ["LlamaForCausalLM"]  # merged/ is used now
    capsys.readouterr()
    for where in (sft_run, sft_run / "merged"):
        assert main(["chat", str(where), "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0
        assert capsys.readouterr().out.rstrip().endswith(expected)


def test_reward_models_are_refused_with_an_explanation(tmp_path, capsys):
    run = tmp_path / "rm"
    run.mkdir()
    (run / "lineage.json").write_text(json.dumps({"stage": "rm", "model_head": "score"}))
    assert main(["chat", str(run), "--prompt", "hi"]) == 1
    assert "reward model" in capsys.readouterr().err
    tok = make_tiny_tokenizer()
    LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_labels=1)
                                   ).save_pretrained(tmp_path / "merged_rm")
    with pytest.raises(ChatError, match="outputs one score"):
        load_for_chat(tmp_path / "merged_rm")
    with pytest.raises(ChatError, match="neither a model directory"):
        load_for_chat(tmp_path / "nothing")


def test_reply_stops_at_the_templates_end_of_turn_not_only_the_tokenizer_eos():
    tok = make_tiny_tokenizer(template="llama2")  # EOS </s>
    tok.chat_template = CHATML_TEMPLATE  # assistant turns end with <|im_end|>
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end != tok.eos_token_id
    model = make_tiny_llama(tok).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.lm_head = torch.nn.Linear(32, len(tok), bias=True)  # always predicts <|im_end|>
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.zero_()
        model.lm_head.bias[end] = 10.0
    assert generate_reply(model, tok, [{"role": "user", "content": PROMPT}], max_new_tokens=8) == [end]


def test_chat_with_a_pipeline_directory_uses_its_merged_model(sft_run, tmp_path, capsys):
    """`llmtune pipeline` writes <dir>/<step>/ runs and <dir>/merged (no lineage.json at the top): chat uses merged/;
    before the export it names the step runs to chat with instead."""
    import shutil

    pipe = tmp_path / "pipe"
    shutil.copytree(sft_run, pipe / "sft", ignore=shutil.ignore_patterns("merged"))
    with pytest.raises(ChatError, match=r"pipeline directory without an exported merged/.*llmtune chat .*sft"):
        load_for_chat(pipe)
    export_run(pipe / "sft", dtype="fp32", out_dir=pipe / "merged")
    (pipe / "pipeline_summary.json").write_text("{}")
    capsys.readouterr()
    assert main(["chat", str(pipe), "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0
    reply = capsys.readouterr().out.rstrip()
    capsys.readouterr()
    assert main(["chat", str(pipe / "merged"), "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0
    assert reply and capsys.readouterr().out.rstrip().endswith(reply.splitlines()[-1])
