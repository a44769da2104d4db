"""Checks of a GGUF against the merged model it was converted from, run in llama.cpp (llama-cpp-python's ``Llama``,
the real library) and in transformers.

What a llama.cpp user sees, checked one by one (each check returns a JSON-ready dict with ``passed``):

- :func:`check_tokenizer`: the GGUF tokenizes every test string (:data:`TOKENIZER_TEXTS`: prompts, whitespace runs,
  digits, code, accents, CJK, emoji, special-token text, llama.cpp's own pre-tokenizer probe) to exactly the HF
  tokenizer's ids (``tokenizer(text)``, BOS as the tokenizer adds it; special-token text parsed as HF does); its
  embedded chat template is the merged tokenizer's, its BOS/EOS are the tokenizer's, and every stop token of the
  merged model (:func:`llmtune.data.templates.stop_token_ids`) ends generation in llama.cpp (``llama_vocab_is_eog``).
- :func:`check_chat`: a chat through llama-cpp-python (``create_chat_completion``, greedy: the GGUF's own template
  rendered by its Jinja chat handler) evaluates exactly the prompt ids of ``apply_chat_template(...,
  add_generation_prompt=True)`` and ends like the merged model's greedy reply (same text, stopped at a stop token or
  cut at the token limit alike).
- float GGUFs: :func:`logit_report`: next-token logits at every position of the sample prompts within
  ``atol + rtol * max|logit|`` (:data:`TOLERANCE`) of the merged model's (fp32), and greedy generations equal (or
  parting only at a near-tie, as the merge check allows).
- quantized GGUFs: :func:`quant_report`: on a held-out text (:data:`HELD_OUT_TEXT`, in no training set), the share
  of positions whose top-1 token equals the f16 GGUF's and the perplexity of both (fails below/above
  :data:`QUANT_LIMITS`), and the mean KL divergence from the f16 GGUF's next-token distribution (a broken quantization is caught:
  tests/unit/export/test_gguf_export.py corrupts one).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from llmtune.export.llamacpp import GGUFExportError, llama_cpp_module, silence_llama

# max |gguf - merged| <= atol + rtol * max|merged logit|. llama.cpp keeps its KV cache in f16 (its default, what
# users run), so even an f32 GGUF differs by f16 rounding of keys and values; f16/bf16 also round the weights (and,
# in the CPU matmul, the activations) to 11 / 8 significant bits. Measured (max |diff| at max |logit|): SmolLM2-135M
# (30 layers) f32 0.044 and f16 0.092 at 39.7; tiny 2-layer models f16 0.02-0.16 at 20. A wrong conversion is off by
# whole logits (a Qwen3-MoE router normalized differently: 4.8).
TOLERANCE = {"f32": (0.05, 0.01), "f16": (0.05, 0.015), "bf16": (0.25, 0.04)}
# A quantized GGUF vs the f16 GGUF on the held-out text: top-1 agreement at least, perplexity ratio at most (mean KL
# is reported beside, as llama-perplexity --kl-divergence reports it). Measured on SmolLM2-135M (292 held-out tokens;
# a small model, which loses more to quantization than large ones, and whose 576-wide rows make llama.cpp fall back
# from k-quants to q5_0/q5_1/q8_0 blocks): q8_0 0.973 / 1.005, q6_k 0.955 / 0.997, q5_k_m 0.873 / 1.072, q4_k_m
# 0.877 / 1.034, q4_0 0.764 / 1.140; limits ~3 standard errors of a 292-token agreement (0.02) below. A GGUF whose
# weights were scrambled scores ~0.3 top-1.
QUANT_LIMITS = {
    "q8_0": {"top1": 0.90, "ppl_ratio": 1.05},
    "q6_k": {"top1": 0.85, "ppl_ratio": 1.08},
    "q5_k_m": {"top1": 0.80, "ppl_ratio": 1.15},
    "q4_k_m": {"top1": 0.75, "ppl_ratio": 1.25},
    "q4_0": {"top1": 0.65, "ppl_ratio": 1.40},
}
GENERATION_TOKENS = 24

# llama.cpp's own pre-tokenizer probe (convert_hf_to_gguf.py get_vocab_base_pre) and texts of the kinds that split
# differently under a wrong pre-tokenizer or normalizer.
TOKENIZER_TEXTS = [
    "Hello world",
    " Hello  world,   again\n\n\tand\ttabs \n",
    "Natalia sold 48 clips in April; 1234567 / 89 = 13871.53, 3.3 3..3 3...3 1,000,000",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # -> 3\n",
    "naïve café résumé Ünïcödé — “quotes” ‘single’ …",
    "我想在apple工作1314151天～ нещо на Български",
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "------======= ''''''```````\"\"\"\"......!!!!!!??????",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
    "3 33 333 3333 33333 333333 3333333 33333333",
]

HELD_OUT_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lamp room he could see the "
    "harbor, the fishing boats returning with their catch, and the long line of cliffs that ran north toward the "
    "next village. In winter the storms came in from the west, and he kept a log of every ship that passed: its "
    "name, the time, and the direction of the wind.\n\n"
    "A train leaves the station at 9:15 and travels at 80 kilometers per hour. A second train leaves the same "
    "station at 10:00 on a parallel track at 100 kilometers per hour. The second train catches up when both have "
    "covered the same distance: 80 t = 100 (t - 0.75), so t = 3.75 hours, at 15:00, 300 kilometers from the station.\n\n"
    "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, and let it rise in a warm "
    "place until it doubles in size. Shape the loaf, let it rise again, and bake it in a hot oven until the crust "
    "is brown and the bottom sounds hollow when tapped.\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
)


def threads() -> int:
    """CPU threads for llama.cpp: ``$OMP_NUM_THREADS`` if set (tests pin it to 1), else every core."""
    return max(1, int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))


def load(path: Path, n_ctx: int = 1024, logits_all: bool = True):
    """A llama-cpp-python ``Llama`` on ``path`` (CPU, quiet, fixed seed).

    Raises:
        GGUFExportError: llama.cpp cannot load the file (its message).
    """
    llama_cpp = llama_cpp_module()
    silence_llama()
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 512), logits_all=logits_all,
                               n_threads=threads(), n_threads_batch=threads(), seed=0, verbose=False)
    except (ValueError, RuntimeError) as err:
        raise GGUFExportError(f"llama.cpp cannot load {path}: {err}") from None


def gguf_logits(llm, ids: list[int]) -> np.ndarray:
    """(T, V) fp32 next-token logits at every position of ``ids``."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def is_eog(llm, token: int) -> bool:
    llama_cpp = llama_cpp_module()
    return bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, token))  # noqa: SLF001 - the model's vocab handle


def gguf_greedy(llm, ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy continuation, stopping after an end-of-generation token (included, as transformers includes its EOS):
    ``(new ids, (N, V) logits at each generated position)``."""
    out, logits = [], []
    llm.reset()
    llm.eval(ids)
    for _ in range(max_new_tokens):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        token = int(row.argmax())
        out.append(token)
        logits.append(row)
        if is_eog(llm, token):
            break
        llm.eval([token])
    return out, np.stack(logits) if logits else np.zeros((0, 0), np.float32)


# ---- tokenizer, template and stop tokens ---------------------------------------------------------------------

def check_tokenizer(llm, tokenizer, stop_ids: list[int]) -> dict:
    """Tokenization, embedded chat template, BOS/EOS and stop tokens of a loaded GGUF vs the HF tokenizer."""
    mismatches = []
    texts = [*TOKENIZER_TEXTS, *_special_texts(tokenizer)]
    for text in texts:
        want = tokenizer(text)["input_ids"]
        got = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if list(got) != list(want):
            mismatches.append({"text": text, "hf": want[:64], "gguf": list(got)[:64]})
    meta = llm.metadata
    template = meta.get("tokenizer.chat_template")
    eog = {tokenizer.convert_ids_to_tokens(i): is_eog(llm, i) for i in stop_ids}
    bos, eos = llm.token_bos(), llm.token_eos()
    report = {
        "strings": len(texts), "mismatches": mismatches,
        "chat_template_embedded": template == tokenizer.chat_template,
        "bos": {"gguf": bos, "hf": tokenizer.bos_token_id}, "eos": {"gguf": eos, "hf": tokenizer.eos_token_id},
        "stop_tokens_end_generation": eog,
        "pre_tokenizer": meta.get("tokenizer.ggml.pre"),
    }
    bos_ok = tokenizer.bos_token_id is None or bos == tokenizer.bos_token_id or not _adds_bos(tokenizer)
    report["passed"] = (not mismatches and report["chat_template_embedded"] and all(eog.values()) and bos_ok
                        and eos == tokenizer.eos_token_id)
    return report


def _adds_bos(tokenizer) -> bool:
    return tokenizer.bos_token_id is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]


def _special_texts(tokenizer) -> list[str]:
    """Texts holding the template's special tokens: one rendered conversation, and the special tokens glued to
    words."""
    texts = []
    if tokenizer.chat_template:
        conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "It is 5."}]
        try:
            texts.append(tokenizer.apply_chat_template(conv, tokenize=False))
        except Exception:  # noqa: BLE001 - a template without a system role
            texts.append(tokenizer.apply_chat_template(conv[1:], tokenize=False))
    specials = [t for t in tokenizer.all_special_tokens if t][:6]
    texts.append("word" + "x".join(specials) + " end")
    return texts


# ---- chat through llama-cpp-python ---------------------------------------------------------------------------

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 * 7?"}],
    [{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How are you today?"},
     {"role": "user", "content": "Write one sentence about the sea."}],
]


def check_chat(llm, tokenizer, reference: list[tuple[list[int], object]], max_tokens: int, stop_ids: list[int],
               tolerance: float) -> dict:
    """Chat completions through llama-cpp-python vs the merged model.

    Args:
        llm: the GGUF, loaded.
        tokenizer: the merged model's tokenizer.
        reference: per :func:`usable_conversations` entry, the merged model's greedy reply: ``(ids, (N, V) logits)``
            (ids end with a stop token when it stopped).
        max_tokens: the generation limit both used.
        stop_ids: the merged model's stop tokens.
        tolerance: logit tolerance of a near-tie (a reply may part from the merged model's only where its two
            choices are closer than that).

    Returns:
        ``{"conversations": [{prompt_ids_equal, reply_equal, near_tie, stopped_alike, hf_text, gguf_text,
        finish_reason}], "passed", "replies_alike"}``: ``passed`` = equal prompt ids everywhere; ``replies_alike`` =
        every reply equal with the same ending, or parting at a near-tie (required of float GGUFs by the caller).
    """
    from llmtune.export.merge import compare_generations

    rows = []
    for conv, (ref_ids, ref_logits) in zip(usable_conversations(tokenizer), reference):
        want = list(tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
        llm.reset()
        res = llm.create_chat_completion(messages=conv, max_tokens=max_tokens, temperature=0.0, top_k=1, seed=0)
        n_prompt = res["usage"]["prompt_tokens"]
        got = [int(t) for t in llm.input_ids[:n_prompt]]
        text = res["choices"][0]["message"]["content"] or ""
        finish = res["choices"][0]["finish_reason"]
        ref_stopped = bool(ref_ids) and ref_ids[-1] in stop_ids
        ids = [int(t) for t in llm.input_ids[n_prompt:llm.n_tokens]]  # the reply tokens llama.cpp evaluated
        ref = list(ref_ids)
        if finish == "stop":  # the end-of-generation token it sampled is never evaluated
            ids.append(ref_ids[-1] if ref_stopped else stop_ids[0])
        elif len(ids) < res["usage"]["completion_tokens"]:  # cut at max_tokens: the last token was not evaluated
            ref = ref[:len(ids)] if len(ref) > len(ids) and not ref_stopped else ref
        cmp = compare_generations([(ref, ref_logits)], [(ids, None)], tokenizer, tolerance)[0]
        rows.append({"prompt_ids_equal": got == want, "prompt_tokens": len(want), "reply_equal": cmp["match"],
                     "near_tie": cmp.get("near_tie", False), "stopped_alike": (finish == "stop") == ref_stopped,
                     "hf_text": cmp["adapter_text"], "gguf_text": text, "finish_reason": finish})
        if got != want:
            rows[-1].update(hf_prompt_ids=want[:80], gguf_prompt_ids=got[:80])
    return {"conversations": rows, "passed": all(r["prompt_ids_equal"] for r in rows),
            "replies_alike": all((r["reply_equal"] and r["stopped_alike"]) or r["near_tie"] for r in rows)}


def usable_conversations(tokenizer) -> list[list[dict]]:
    """:data:`CHAT_CONVERSATIONS` that the template renders (a template refusing system messages skips those)."""
    out = []
    for conv in CHAT_CONVERSATIONS:
        try:
            tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001
            continue
        out.append(conv)
    return out


# ---- logits and quantization ---------------------------------------------------------------------------------

def logit_report(gguf_logits_list: list[np.ndarray], ref_logits: list[np.ndarray], gtype: str) -> dict:
    """Max |logit diff| of a float GGUF vs the merged model over every position of the sample prompts, against
    :data:`TOLERANCE`, and the argmax agreement."""
    diff = max(float(np.abs(g - r).max()) for g, r in zip(gguf_logits_list, ref_logits))
    scale = max(float(np.abs(r).max()) for r in ref_logits)
    atol, rtol = TOLERANCE[gtype]
    agree = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(gguf_logits_list, ref_logits))
    total = sum(r.shape[0] for r in ref_logits)
    tolerance = atol + rtol * scale
    return {"max_abs_diff": diff, "max_abs_logit": scale, "tolerance": tolerance, "argmax_agreement": agree / total,
            "positions": total, "passed": diff <= tolerance}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp(mean NLL) of ``ids[1:]`` under ``logits[:-1]`` ((T, V), position t predicts token t+1)."""
    lp = log_softmax(logits[:-1])
    nll = -lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return float(math.exp(nll.mean()))


def quant_report(q_logits: np.ndarray, f16_logits: np.ndarray, ids: list[int], qtype: str) -> dict:
    """A quantized GGUF vs the f16 GGUF on the held-out text: top-1 agreement, mean KL(f16 || quant) per position,
    both perplexities and their ratio, against :data:`QUANT_LIMITS`."""
    lp_f, lp_q = log_softmax(f16_logits), log_softmax(q_logits)
    kl = float((np.exp(lp_f) * (lp_f - lp_q)).sum(-1).mean())
    top1 = float((q_logits.argmax(-1) == f16_logits.argmax(-1)).mean())
    ppl_q, ppl_f = perplexity(q_logits, ids), perplexity(f16_logits, ids)
    limits = QUANT_LIMITS[qtype]
    passed = top1 >= limits["top1"] and ppl_q / ppl_f <= limits["ppl_ratio"]  # KL reported, not gated: its scale
    # follows the logits' (a tiny test model's overconfident logits give q4_k_m 0.2 at 0.87 top-1 agreement)
    return {"top1_agreement_vs_f16": top1, "mean_kl_vs_f16": kl, "perplexity": ppl_q, "perplexity_f16": ppl_f,
            "perplexity_ratio": ppl_q / ppl_f, "positions": len(ids), "limits": limits, "passed": bool(passed)}
