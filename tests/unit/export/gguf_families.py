"""Tiny models of the families GGUF export supports, built from transformers' own config classes (nothing
downloaded), and a merged-model directory made from one: the tiny offline tokenizer (llmtune.models.tiny), a few
hundred Adam steps so that the model answers the chat checks' questions and ENDS its replies with the template's
end-of-turn token (a random model never stops, so "stops where the merged model stops" would test nothing), saved as
``export_run`` saves a merged model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmtune.models.tiny import make_tiny_tokenizer


def _common(tokenizer, hidden: int, layers: int) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)


def tiny_config(family: str, tokenizer, hidden: int = 64, layers: int = 2):
    """A transformers config of ``family`` (``llama``, ``qwen3``, ``mistral``, ``gemma3``, ``qwen3_moe``, ``phi3``,
    ``olmo2``, ``granite``) sized for tests."""
    import transformers as tf

    c = _common(tokenizer, hidden, layers)
    if family == "llama":
        return tf.LlamaConfig(**c)
    if family == "qwen3":
        return tf.Qwen3Config(**c, head_dim=hidden // 4)
    if family == "mistral":
        return tf.MistralConfig(**c, sliding_window=None)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**c, head_dim=hidden // 4, sliding_window=64, query_pre_attn_scalar=hidden // 4)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**c, head_dim=hidden // 4, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=hidden, decoder_sparse_step=1,
                                 norm_topk_prob=True)  # as Qwen3-30B-A3B; llama.cpp always normalizes (False: caught, 4.8 off)
    if family == "phi3":
        return tf.Phi3Config(**c)
    if family == "olmo2":
        return tf.Olmo2Config(**c)
    if family == "granite":
        return tf.GraniteConfig(**c)
    raise ValueError(f"unknown tiny family {family!r}")


FAMILIES = ["llama", "qwen3", "mistral", "gemma3", "qwen3_moe", "phi3", "olmo2", "granite"]

# What the model learns to answer (the chat checks' conversations and the merge check's sample prompts).
LESSONS = [
    ([{"role": "user", "content": "What is 12 * 7?"}], "12 * 7 = 84."),
    ([{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": "Say hello."}],
     "Hello! How are you today?"),
    ([{"role": "user", "content": "Write one sentence about the sea."}], "The sea is wide and blue."),
]


def teach(model, tokenizer, steps: int = 150, lr: float = 1e-2) -> None:
    """Fit ``model`` (in place, fp32) to reply to each lesson with its answer followed by the end-of-turn token."""
    rows = []
    for conv, answer in LESSONS:
        ids = tokenizer.apply_chat_template(conv + [{"role": "assistant", "content": answer}], tokenize=True,
                                            return_dict=True)["input_ids"]
        rows.append(torch.tensor([ids]))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        for x in rows:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    model.eval()


def save_merged(path: Path, family: str = "llama", tokenizer=None, hidden: int = 64, layers: int = 2,
                steps: int = 150, seed: int = 0) -> Path:
    """A merged-model directory (model, tokenizer with chat template, a passed verification.json) of a taught tiny
    ``family`` model."""
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer or make_tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tokenizer, hidden, layers), dtype=torch.float32)
    if steps:
        teach(model, tokenizer, steps)
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "verification.json").write_text(json.dumps({"passed": True, "note": "tiny test model"}))
    return path


def make_tiny_spm_tokenizer(directory: Path, chat_template: str):
    """A SentencePiece BPE vocabulary (as Gemma's and Mistral v0.1-0.3's are) trained offline on the tiny corpus:
    ``directory`` gets ``tokenizer.model`` + ``tokenizer_config.json``; returns the HF tokenizer loaded from it (which
    transformers 5 saves as tokenizer.json only)."""
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    from llmtune.models.tiny import _CORPUS

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 20), model_writer=model, vocab_size=600, model_type="bpe", byte_fallback=True,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        character_coverage=1.0, split_digits=True, add_dummy_prefix=False, minloglevel=2)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "add_bos_token": True, "add_eos_token": False}))
    tok = AutoTokenizer.from_pretrained(directory)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = chat_template
    return tok
