"""``llmtune export RUN --gguf TYPE``: the verified merged model as GGUF files for llama.cpp, Ollama and LM Studio.

Flow (one direction): the run's merged model (``RUN/merged``, exported and verified first when it is missing or
older than the run; a pipeline directory's ``merged/``) -> llama.cpp's converter -> ``model-f16.gguf`` (and the
other float types) -> llama.cpp's quantizer -> ``model-<TYPE>.gguf`` -> every file checked in llama.cpp against the
merged model (:mod:`~llmtune.export.gguf_verify`) -> ``verification.json`` and an Ollama ``Modelfile``
(:mod:`~llmtune.export.modelfile`) in ``RUN/gguf/`` (or ``--out``). The f16 file is the reference of the quantized
ones and is kept only when asked for.

The chat template is checked BEFORE anything is converted: a template Ollama's Go templates cannot express is
refused (``--no-modelfile`` writes the GGUF alone; llama.cpp and LM Studio use the Jinja template embedded in it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from llmtune.core import rundir as rd
from llmtune.export.llamacpp import (
    FLOAT_TYPES, GGUF_TYPES, GGUFExportError, check_architecture, check_versions, convert, converter_dir, quantize,
    versions,
)
from llmtune.utils import get_logger, setup_logging, write_json

log = get_logger("export")

MERGED = "merged"
GGUF_DIR = "gguf"


def parse_types(spec: str | list[str]) -> list[str]:
    """``"q4_k_m,q8_0"`` or a list -> validated lower-case types, in order, without repeats.

    Raises:
        GGUFExportError: an unknown type (lists the known ones).
    """
    items = spec.split(",") if isinstance(spec, str) else [t for s in spec for t in s.split(",")]
    types = list(dict.fromkeys(t.strip().lower() for t in items if t.strip()))
    bad = [t for t in types if t not in GGUF_TYPES]
    if bad or not types:
        raise GGUFExportError(f"unknown GGUF type(s) {', '.join(bad) or '(none given)'}; --gguf takes one or more "
                              f"of {', '.join(GGUF_TYPES)} (comma-separated), e.g. --gguf q4_k_m")
    return types


def merged_model_dir(path: Path) -> Path:
    """The verified merged model to convert: ``path`` itself (a merged directory), ``path/merged`` of a pipeline, or
    ``path/merged`` of a run, exported (merged and verified, :func:`llmtune.export.merge.export_run`) first when it
    is missing, failed, or older than the run.

    Raises:
        GGUFExportError: nothing exportable at ``path``, or a merged model whose verification failed.
    """
    if (path / "config.json").is_file():
        merged = path
    else:
        merged = path / MERGED
        report = merged / "verification.json"
        if (path / rd.LINEAGE).is_file():
            fresh = report.is_file() and report.stat().st_mtime > (path / rd.LINEAGE).stat().st_mtime
            if not fresh or not json.loads(report.read_text()).get("passed"):
                from llmtune.export.merge import export_run

                log.info("no verified merged model in %s: exporting it first", merged)
                export_run(path, out_dir=merged)
        elif not report.is_file():
            raise GGUFExportError(f"{path} holds no merged model (no {MERGED}/verification.json) and is not a "
                                  "finished run (no lineage.json); give a run directory, a pipeline directory after "
                                  "its export step, or a merged model directory")
    report = merged / "verification.json"
    if report.is_file() and not json.loads(report.read_text()).get("passed"):
        raise GGUFExportError(f"the merged model {merged} failed its own verification ({report}); a GGUF of it would "
                              "carry the same fault. Fix the merge first (llmtune export RUN)")
    return merged


SPM_FILE = "tokenizer.model"


def sentencepiece_model(path: Path, merged: Path) -> Path | None:
    """The SentencePiece model of a merged model whose vocabulary is one (Mistral v0.1-0.3, Gemma, Llama 2): llama.cpp
    converts such vocabularies from ``tokenizer.model``, which transformers 5 no longer writes with
    ``save_pretrained``. Looked for in the merged directory, then in the base model's directory named by the run's
    ``lineage.json`` (``base_model.path``: the hub snapshot or local directory training loaded). None when neither has
    one (a byte-level BPE vocabulary needs none)."""
    if (merged / SPM_FILE).is_file():
        return merged / SPM_FILE
    for lineage in (path / rd.LINEAGE, merged.parent / rd.LINEAGE):
        if lineage.is_file():
            base = (json.loads(lineage.read_text()).get("base_model") or {}).get("path")
            if base and (Path(base) / SPM_FILE).is_file():
                return Path(base) / SPM_FILE
    return None


def conversion_source(merged: Path, spm: Path | None, staging: Path) -> Path:
    """The directory the converter reads: ``merged`` itself for a byte-level BPE vocabulary; for a SentencePiece one
    a staging directory of links to the merged files plus ``tokenizer.model`` and a ``tokenizer_config.json`` with
    ``added_tokens_decoder``: llama.cpp's SentencePiece path learns which added tokens are special (``<start_of_turn>``,
    ...) only from that key, which transformers 5 writes into tokenizer.json's ``added_tokens`` instead (without it
    llama.cpp would tokenize the chat template's special tokens as text)."""
    if spm is None:
        return merged
    import shutil

    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in merged.iterdir():
        if f.is_file() and f.name not in (SPM_FILE, "tokenizer_config.json"):
            (staging / f.name).symlink_to(f.resolve())
    shutil.copyfile(spm, staging / SPM_FILE)
    config_path = merged / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    tokenizer_json = merged / "tokenizer.json"
    if "added_tokens_decoder" not in config and tokenizer_json.is_file():
        keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        config["added_tokens_decoder"] = {str(t["id"]): {k: t[k] for k in keys if k in t}
                                          for t in json.loads(tokenizer_json.read_text()).get("added_tokens", [])}
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return staging


def export_gguf(path: str | Path, types: str | list[str], out_dir: str | Path | None = None, modelfile: bool = True,
                max_new_tokens: int | None = None) -> dict:
    """Convert, quantize and verify; writes ``model-<TYPE>.gguf``, ``Modelfile`` and ``verification.json``.

    Args:
        path: a run directory, a pipeline directory, or a merged model directory.
        types: GGUF types (:data:`llmtune.export.llamacpp.GGUF_TYPES`), a list or ``"q4_k_m,q8_0"``.
        out_dir: default ``<path>/gguf`` (next to ``merged/``).
        modelfile: write the Ollama Modelfile (refuses a chat template Ollama cannot express).
        max_new_tokens: greedy tokens per generation comparison (default
            :data:`llmtune.export.gguf_verify.GENERATION_TOKENS`).

    Returns:
        The verification report (``passed``, per type ``types[TYPE]``, ``modelfile``, versions, timings).

    Raises:
        GGUFExportError: llama.cpp missing, unsupported architecture, pre-tokenizer or chat template, a failed
            conversion; see :func:`merged_model_dir`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtune.data.templates import stop_token_ids
    from llmtune.export import gguf_verify as gv
    from llmtune.export.merge import _generate, sample_inputs
    from llmtune.export.modelfile import TemplateNotExpressible, turn_format

    setup_logging()
    t_start = time.perf_counter()
    types = parse_types(types)
    path = Path(path)
    found = versions()  # llama.cpp present (library and converter) before any work
    check_versions(found)
    merged = merged_model_dir(path)
    out = Path(out_dir) if out_dir else (path if merged != path else path.parent) / GGUF_DIR
    arch = check_architecture(merged, converter_dir())
    tokenizer = AutoTokenizer.from_pretrained(merged)
    fmt = None
    if modelfile:
        try:
            fmt = turn_format(tokenizer)
        except TemplateNotExpressible as err:
            raise GGUFExportError(
                f"the chat template of {merged} cannot be written as an Ollama Modelfile TEMPLATE: {err}. Ollama would "
                "render other prompts than the model was trained on. Export with --no-modelfile to write the GGUF "
                "alone (llama.cpp and LM Studio render the Jinja template embedded in it), or train with a fixed "
                "turn format such as data.chat_template: chatml") from None
    gen_tokens = max_new_tokens or gv.GENERATION_TOKENS

    # -- the merged model's answers (fp32), computed once
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    stop_ids = stop_token_ids(tokenizer, model.generation_config)
    pad = tokenizer.pad_token_id
    inputs = sample_inputs(tokenizer)
    with torch.no_grad():
        ref_logits = [model(input_ids=x).logits[0].float().numpy() for x in inputs]
    ref_gens = _generate(model, inputs, stop_ids, pad, gen_tokens)
    chats = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_tensors="pt",
                                           return_dict=True)["input_ids"] for c in gv.usable_conversations(tokenizer)]
    chat_gens = _generate(model, chats, stop_ids, pad, gen_tokens)
    held = tokenizer(gv.HELD_OUT_TEXT)["input_ids"]
    with torch.no_grad():
        hf_ppl = gv.perplexity(model(input_ids=torch.tensor([held])).logits[0].float().numpy(), held)
    del model
    n_ctx = max(max(x.shape[1] for x in inputs + chats) + gen_tokens + 8, len(held) + 8, 256)

    # -- convert and quantize
    out.mkdir(parents=True, exist_ok=True)
    files = {t: out / f"model-{t}.gguf" for t in types}
    f16 = files.get("f16", out / ".model-f16.tmp.gguf")
    timings: dict = {}
    spm = sentencepiece_model(path, merged)
    source = conversion_source(merged, spm, out / ".convert-source")
    try:
        conv = convert(source, f16, "f16")
        conv["sentencepiece_model"] = str(spm) if spm else None
        timings["convert_f16_s"] = conv.pop("seconds")
        for t in types:
            if t in FLOAT_TYPES and t != "f16":
                timings[f"convert_{t}_s"] = convert(source, files[t], t)["seconds"]
            elif t not in FLOAT_TYPES:
                timings[f"quantize_{t}_s"] = round(quantize(f16, files[t], t), 2)

        # -- verify each file in llama.cpp
        report: dict = {
            "merged_dir": str(merged), "out_dir": str(out), "architecture": arch, **conv, "llama_cpp": found,
            "stop_tokens": tokenizer.convert_ids_to_tokens(stop_ids), "generation_tokens": gen_tokens,
            "held_out_tokens": len(held), "perplexity_merged_fp32": hf_ppl, "types": {},
        }
        llm = gv.load(f16, n_ctx)
        f16_held = gv.gguf_logits(llm, held)
        report["perplexity_f16"] = gv.perplexity(f16_held, held)
        del llm
        ref = {"inputs": inputs, "logits": ref_logits, "gens": ref_gens, "chats": chat_gens, "held": held,
               "f16_held": f16_held, "stop_ids": stop_ids, "gen_tokens": gen_tokens, "n_ctx": n_ctx}
        for t in types:
            report["types"][t] = _verify_file(t, files[t], tokenizer, ref)

    finally:  # the f16 reference (unless asked for) and the staging directory go, also after a failure
        if "f16" not in types:
            f16.unlink(missing_ok=True)
        if source != merged:
            import shutil

            shutil.rmtree(source, ignore_errors=True)

    if fmt is not None:
        from llmtune.export.modelfile import go_template, modelfile_text

        text = modelfile_text(files[types[0]].name, go_template(fmt), _stop_texts(tokenizer, stop_ids),
                              [files[t].name for t in types[1:]])
        (out / "Modelfile").write_text(text)
        report["modelfile"] = check_modelfile(out / "Modelfile", tokenizer, files[types[0]], stop_ids, n_ctx)
        log.info("Modelfile %s: TEMPLATE renders the HF chat template's ids on %d conversations: %s",
                 out / "Modelfile", len(report["modelfile"]["conversations"]),
                 "yes" if report["modelfile"]["passed"] else "NO")
    report["passed"] = all(e["passed"] for e in report["types"].values()) and \
        report.get("modelfile", {"passed": True})["passed"]
    timings["total_s"] = round(time.perf_counter() - t_start, 2)
    report["timings"] = timings
    write_json(out / "verification.json", report)
    (log.info if report["passed"] else log.error)("GGUF export %s: %s -> %s", out, ", ".join(
        f"{t} ({report['types'][t]['bytes'] / 2**20:.1f} MiB)" for t in types), "PASSED" if report["passed"] else "FAILED")
    return report


def _verify_file(t: str, path: Path, tokenizer, ref: dict) -> dict:
    """The checks of one GGUF (:mod:`~llmtune.export.gguf_verify`) against the merged model's answers ``ref``."""
    from llmtune.export import gguf_verify as gv

    t0 = time.perf_counter()
    llm = gv.load(path, ref["n_ctx"])
    entry = {"file": path.name, "bytes": path.stat().st_size,
             "tokenizer": gv.check_tokenizer(llm, tokenizer, ref["stop_ids"])}
    if t in FLOAT_TYPES:
        entry["logits"] = gv.logit_report([gv.gguf_logits(llm, x[0].tolist()) for x in ref["inputs"]], ref["logits"], t)
        tolerance = entry["logits"]["tolerance"]
        greedy = [gv.gguf_greedy(llm, x[0].tolist(), ref["gen_tokens"]) for x in ref["inputs"]]
        entry["generations"] = _compare(ref["gens"], greedy, tokenizer, tolerance)
        entry["chat"] = gv.check_chat(llm, tokenizer, ref["chats"], ref["gen_tokens"], ref["stop_ids"], tolerance)
        entry["passed"] = (entry["tokenizer"]["passed"] and entry["chat"]["passed"] and entry["logits"]["passed"]
                           and entry["chat"]["replies_alike"]  # the chat ends as the merged model's does
                           and all(g["match"] or g["near_tie"] for g in entry["generations"]))
    else:
        entry["chat"] = gv.check_chat(llm, tokenizer, ref["chats"], ref["gen_tokens"], ref["stop_ids"], 0.0)
        entry["quantization"] = gv.quant_report(gv.gguf_logits(llm, ref["held"]), ref["f16_held"], ref["held"], t)
        entry["passed"] = entry["tokenizer"]["passed"] and entry["chat"]["passed"] and entry["quantization"]["passed"]
    del llm
    entry["verify_s"] = round(time.perf_counter() - t0, 2)
    _log_entry(t, entry)
    return entry


def _compare(reference, got, tokenizer, tolerance):
    from llmtune.export.merge import compare_generations

    return compare_generations(reference, [(ids, None) for ids, _ in got], tokenizer, tolerance)


def _stop_texts(tokenizer, stop_ids: list[int]) -> list[str]:
    return [t for t in tokenizer.convert_ids_to_tokens(stop_ids) if t]


def check_modelfile(path: Path, tokenizer, gguf: Path, stop_ids: list[int], n_ctx: int = 512) -> dict:
    """Parse a written Modelfile and check it as Ollama would use it: its ``TEMPLATE`` (Go) rendered for the check
    conversations and tokenized by the GGUF as Ollama's runner does (BOS added when the GGUF says, special tokens
    parsed) gives exactly the ids of ``apply_chat_template``; its ``stop`` parameters are the merged model's stop
    tokens; ``FROM`` names an existing file."""
    from llmtune.export import gguf_verify as gv
    from llmtune.export.modelfile import check_conversations, parse_modelfile, render_go_template

    spec = parse_modelfile(path.read_text())
    llm = gv.load(gguf, n_ctx, logits_all=False)
    rows = []
    for conv in check_conversations():
        gen = conv[-1]["role"] != "assistant"
        try:
            want = list(tokenizer.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True,
                                                      return_dict=True)["input_ids"])
        except Exception:  # noqa: BLE001 - a template without a system role: the conversation does not apply
            continue
        text = render_go_template(spec["template"], {"Messages": [{"Role": m["role"], "Content": m["content"]}
                                                                  for m in conv]})
        got = list(llm.tokenize(text.encode("utf-8"), add_bos=True, special=True))
        rows.append({"roles": [m["role"] for m in conv], "ids_equal": got == want, **(
            {} if got == want else {"ollama_prompt": text, "hf_ids": want[:80], "ollama_ids": got[:80]})})
    stops = sorted(v for k, v in spec["parameters"] if k == "stop")
    want_stops = sorted(_stop_texts(tokenizer, stop_ids))
    source = path.parent / spec["from"].removeprefix("./")
    return {"conversations": rows, "stop": stops, "stop_equals_stop_tokens": stops == want_stops,
            "from": spec["from"], "passed": all(r["ids_equal"] for r in rows) and stops == want_stops
            and source.is_file()}


def _log_entry(t: str, entry: dict) -> None:
    tok = entry["tokenizer"]
    parts = [f"tokenization {tok['strings'] - len(tok['mismatches'])}/{tok['strings']} strings equal",
             "chat prompt ids " + ("equal" if entry["chat"]["passed"] else "DIFFER") + ", replies equal "
             f"{sum(c['reply_equal'] for c in entry['chat']['conversations'])}/{len(entry['chat']['conversations'])}"]
    if "logits" in entry:
        lg = entry["logits"]
        parts.append(f"max |logit diff| {lg['max_abs_diff']:.3g} (tolerance {lg['tolerance']:.3g})")
        parts.append(f"greedy generations identical {sum(g['match'] for g in entry['generations'])}/"
                     f"{len(entry['generations'])}")
    else:
        q = entry["quantization"]
        parts.append(f"top-1 vs f16 {q['top1_agreement_vs_f16']:.3f}, KL {q['mean_kl_vs_f16']:.4f}, perplexity "
                     f"{q['perplexity']:.3f} vs f16 {q['perplexity_f16']:.3f}")
    (log.info if entry["passed"] else log.error)("gguf %s: %s -> %s", t, "; ".join(parts),
                                                 "PASSED" if entry["passed"] else "FAILED")
