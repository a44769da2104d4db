"""Tiny random models and offline tokenizers for tests and dry runs (nothing is downloaded).

``make_tiny_tokenizer`` trains a byte-level BPE on a small built-in corpus in well under a second, so
any text encodes without unknown tokens, and BPE merges cross word boundaries the way real tokenizers
do (needed to test span detection when merges differ in context, trl #598).
"""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-2 style: the template itself renders the BOS text "<s>" (trl #1400 when the tokenizer adds another).
LLAMA2_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ '<<SYS>>\n' + message['content'] + '\n<</SYS>>\n\n' }}{% endif %}"
    "{% endfor %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Natalia sold clips to 48 of her friends in April.",
    "Question: How many eggs does Janet sell? Answer: Janet sells 16 - 3 - 4 = 9 eggs. #### 9",
    "user assistant system Hello! How are you today? I am fine, thank you. What is 2 + 3? It is 5.",
    "She makes 9 * 2 = $18 every day at the market. #### 18 The answer is 42.",
    "Write a poem about the sea. The sea is wide and blue, and the waves come in and out.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "ShareGPT conversations: human gpt from value instruction input output prompt completion text.",
    "0123456789 ten eleven twelve hundred thousand dollars per hour minutes seconds apples oranges.",
]

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<pad>", "<unk>"]


def make_tiny_tokenizer(
    template: str = "chatml",
    add_bos: bool = False,
    pad_equals_eos: bool = True,
    vocab_size: int = 400,
    corpus: list[str] | None = None,
) -> PreTrainedTokenizerFast:
    """Build a byte-level BPE tokenizer offline.

    Args:
        template: ``chatml`` (EOS = ``<|im_end|>``, like SmolLM2) or ``llama2`` (BOS ``<s>`` rendered by
            the template, EOS ``</s>``).
        add_bos: make ``tokenizer(text)`` prepend the BOS id (as Llama tokenizers do).
        pad_equals_eos: use the EOS token as pad token (trl #976 setting).
        vocab_size: BPE vocabulary size including special tokens.
        corpus: extra training texts (so that a test's own texts tokenize into few tokens).

    Returns:
        A ``PreTrainedTokenizerFast`` with ``chat_template`` set.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4 + list(corpus or []) * 4, trainer=trainer)
    if template == "chatml":
        bos, eos, chat = "<|im_start|>", "<|im_end|>", CHATML_TEMPLATE
    elif template == "llama2":
        bos, eos, chat = "<s>", "</s>", LLAMA2_TEMPLATE
    else:
        raise ValueError(f"unknown tiny template {template!r}; use chatml or llama2")
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token="<unk>",
        pad_token=eos if pad_equals_eos else "<pad>",
    )
    fast.chat_template = chat
    fast.add_bos_token = add_bos
    return fast


FAMILIES: dict[str, tuple[str, dict]] = {
    # family (its transformers model_type) -> (config class, settings that make the tiny model exercise what the
    # family does differently from Llama: fused projections, sliding windows, MoE experts, logit scaling)
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),  # q/k norms
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                     "norm_topk_prob": True}),  # experts as 3-D parameters, a router module
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}),  # no sdpa;
    # attention sinks; sliding-window layers alternate with full ones; experts (with biases) stored transposed
    "mistral": ("MistralConfig", {"sliding_window": 8}),  # one sliding window on every layer
    "gemma3_text": ("Gemma3TextConfig", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                         "query_pre_attn_scalar": 8, "final_logit_softcapping": 0.5,
                                         "tie_word_embeddings": True}),  # tied as released; embeddings scaled
    "phi3": ("Phi3Config", {}),  # fused qkv_proj and gate_up_proj linear layers
    "olmo2": ("Olmo2Config", {}),  # norms after attention and MLP, q/k norms over all heads
    "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "logits_scaling": 4.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.25}),
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "logits_scaling": 4.0}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
}
"""Model families :func:`make_tiny_model` builds, by transformers ``model_type``: every family of the docs' families
table (docs/models.md) is tested on such a model."""


def make_tiny_model(
    family: str = "llama",
    tokenizer: PreTrainedTokenizerFast | None = None,
    hidden_size: int = 32,
    num_layers: int = 2,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
):
    """A random ``*ForCausalLM`` of ``family`` (a key of :data:`FAMILIES`) in fp32, built from transformers' own
    config class: ``num_layers`` layers, ``hidden_size`` wide, 4 query heads of ``hidden_size / 4`` and 2 key/value
    heads, its vocabulary matching ``tokenizer`` (default: the tiny one), 4,096 positions; the LM head tied to the
    input embedding when ``tie_word_embeddings`` (None: as the family's released models, Gemma 3 only).

    Raises:
        ValueError: an unknown family.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; known: {', '.join(FAMILIES)}")
    tokenizer = tokenizer or make_tiny_tokenizer()
    class_name, settings = FAMILIES[family]
    config = getattr(transformers, class_name)(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=4096,  # above the default data.max_length (1024): position checks pass
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=settings.get("tie_word_embeddings", False) if tie_word_embeddings is None
        else tie_word_embeddings,
        **{k: (v[:num_layers] if k == "layer_types" else v) for k, v in settings.items()
           if k != "tie_word_embeddings"},
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def make_tiny_llama(
    tokenizer: PreTrainedTokenizerFast | None = None,
    hidden_size: int = 32,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A 2-layer random Llama in fp32 whose vocabulary matches ``tokenizer`` (default: the tiny one)."""
    return make_tiny_model("llama", tokenizer, hidden_size, num_layers, tie_word_embeddings, seed)


def save_tiny_model(path: str | Path, family: str = "llama", **kwargs) -> Path:
    """Write a tiny model of ``family`` (:func:`make_tiny_model`) + the tiny tokenizer as a local HF directory (usable
    as ``model.name_or_path``); ``kwargs``: :func:`make_tiny_tokenizer`'s ``template``/``add_bos``/
    ``pad_equals_eos`` and :func:`make_tiny_model`'s sizes."""
    path = Path(path)
    tokenizer = make_tiny_tokenizer(**{k: kwargs.pop(k) for k in list(kwargs) if k in ("template", "add_bos", "pad_equals_eos")})
    model = make_tiny_model(family, tokenizer, **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
