"""Artifacts that work outside llmtune: adapter metadata, model cards, versions, optional hub upload.

After a stage saved ``adapter/`` (peft writes the machine-local path of the base it was loaded from),
:func:`finalize_adapter_dir` rewrites ``adapter_config.json`` to name the portable base
(:func:`llmtune.models.portable.portable_base`), cleans the saved tokenizer config, and writes the adapter's model
card (``README.md``, where peft users look) with the lineage. An adapter trained on top of an earlier chain
(``model.from_run``) only gives the trained model on the base *with that chain merged*: the card says so first, the
config's ``base_model_name_or_path`` still names the original base (the one thing a user can download), and
``llmtune export RUN --adapter`` writes one adapter equal to the whole chain on that base.
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from llmtune.errors import LlmtuneError
from llmtune.utils import get_logger, project_root

log = get_logger("artifacts")


class HubUploadError(LlmtuneError, RuntimeError):
    """Uploading an artifact to the hub failed (no network or credentials, or the hub refused)."""

VERSIONED = ("torch", "transformers", "peft", "trl", "deepspeed", "bitsandbytes", "datasets", "accelerate")
# builtin data sources -> the hub dataset they are a copy of (for the card's `datasets:`)
HUB_DATASETS = {"builtin:gsm8k": "openai/gsm8k", "builtin:sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered",
                "builtin:hh-rlhf-harmless": "Anthropic/hh-rlhf"}


def package_versions() -> dict[str, str | None]:
    """Installed versions of the libraries a run depends on (``None``: not installed); read from package
    metadata, nothing is imported."""
    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def llmtune_commit() -> str | None:
    """git commit of the llmtune checkout that runs (``+dirty`` with uncommitted changes), or ``None`` when llmtune
    is not run from a git checkout (an installed wheel)."""
    root = project_root()
    if root is None or not (root / ".git").exists():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "") if sha else None


def hub_datasets(sources: list[dict]) -> list[str]:
    """Hub dataset ids among a run's data sources: builtins by their origin, hub sources by name."""
    found = []
    for s in sources:
        path = str(s.get("path", ""))
        if path in HUB_DATASETS:
            found.append(HUB_DATASETS[path])
        elif s.get("location") == path and "/" in path and not Path(path).exists() and path.count("/") == 1:
            found.append(path)
    return list(dict.fromkeys(found))


def front_matter(fields: dict[str, Any]) -> str:
    """YAML front matter of a hub model card (keys with empty values are left out)."""
    import yaml

    kept = {k: v for k, v in fields.items() if v not in (None, [], "")}
    return "---\n" + yaml.safe_dump(kept, sort_keys=False).strip() + "\n---\n"


def chain_warning(chain: list[dict], stacked: bool = False) -> list[str]:
    """Card lines saying that an adapter needs the earlier adapters first (empty for no chain); ``stacked``: they
    were applied unmerged on the quantized base (a QLoRA stage on top of an earlier run)."""
    if not chain:
        return []
    links = " -> ".join(f"{e.get('stage')} (`{e.get('path')}`)" for e in chain)
    how = ("applied first, unmerged on the quantized base (the same BitsAndBytesConfig as below)" if stacked
           else "merged first, in order")
    return ["## This adapter needs earlier adapters", "",
            f"It was trained on the base **with these adapters {how}**: {links}. Loading it on "
            "the base alone gives a different model. For one adapter equal to the whole chain on the base "
            "(loads with plain `PeftModel.from_pretrained`" + (", on the quantized base too" if stacked else "")
            + "), run `llmtune export RUN_DIR --adapter`; for a merged model, `llmtune export RUN_DIR`.", ""]


def usage_snippet(base: dict, adapter_ref: str, head: str, kind: str, local_base: str | None = None,
                  quantization: dict | None = None) -> list[str]:
    """Python usage for a card. ``kind``: ``adapter`` (peft on the base) or ``merged`` (a plain model dir).

    ``local_base``: the directory training loaded the base from (a hub snapshot in the HF cache, or llmtune's
    float32 conversion of a GGUF / ``builtin:`` model); an adapter card then also shows how to load the adapter
    against a local copy of the base, offline (the builtin default has no hub route without network access).
    ``quantization``: how a QLoRA / 8-bit run quantized its base (:func:`llmtune.models.load.quantization_kwargs`):
    an adapter card then loads the base with that ``BitsAndBytesConfig``, the weights the adapter was trained on.
    """
    lines = _snippet(base, adapter_ref, head, kind, quantization)
    if kind == "adapter" and local_base and local_base != base.get("name_or_path"):
        local = {"load": "AutoModelForCausalLM.from_pretrained(BASE_DIR, dtype=torch.float32)"}
        code = _snippet(local, adapter_ref, head, kind, quantization)[3:]  # the code block without "## Usage"
        lines += ["### Offline, with a local copy of the base", "",
                  "`BASE_DIR` below is the directory llmtune loaded the base from on the training machine (a hub "
                  "snapshot in the Hugging Face cache, or llmtune's float32 conversion of a GGUF / builtin model: "
                  "exactly the weights trained against). Elsewhere, use any local copy of the base: a directory "
                  f"written by `save_pretrained`, or `hf download {base.get('name_or_path')} "
                  "--local-dir DIR`. Nothing is downloaded: it works with `HF_HUB_OFFLINE=1`.", "", "```python"]
        blank = code.index("")  # after the imports
        lines += [*code[:blank], "", f'BASE_DIR = "{local_base}"', *code[blank + 1:]]
    return lines


def _snippet(base: dict, adapter_ref: str, head: str, kind: str, quantization: dict | None = None) -> list[str]:
    import re

    auto = "AutoModelForSequenceClassification" if head == "score" else "AutoModelForCausalLM"
    quantized = kind != "merged" and quantization is not None
    if kind == "merged":
        body = [f'model = {auto}.from_pretrained("{adapter_ref}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{adapter_ref}")']
    else:
        load = base.get("load") or f'{auto}.from_pretrained("{base.get("name_or_path")}")'
        load = load.replace("AutoModelForCausalLM", auto)
        if head == "score":  # a keyword after the positional arguments (before them is a SyntaxError)
            load = load[:-1] + ", num_labels=1)"
        body = []
        if quantized:  # the quantized weights the adapter was trained on: the same BitsAndBytesConfig
            args = ", ".join(f"{k}=torch.{v}" if k.endswith("compute_dtype") else f"{k}={v!r}"
                             for k, v in quantization["config"].items())
            load = re.sub(r", dtype=torch\.\w+", "", load)[:-1] + \
                f", quantization_config=bnb, dtype=torch.{quantization['dtype']})"
            body += [f"bnb = BitsAndBytesConfig({args})  # as training quantized the base"]
        body += [f"base = {load}"]
        if quantized:
            body += ["base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)  # norms in fp32, "
                     "as trained"]
            if quantization["config"].get("load_in_4bit"):  # llmtune.models.quant: the CPU repack computes in bf16
                body += ["for module in base.modules():  # on a CPU with AVX-512 BF16, bitsandbytes would run 4-bit "
                         "layers in bf16 at inference",
                         '    if hasattr(module, "support_avx512bf16_for_cpu"):  # whatever the compute dtype: '
                         "keep it, as trained",
                         "        module.support_avx512bf16_for_cpu = False"]
        body += [f'model = PeftModel.from_pretrained(base, "{adapter_ref}")',
                 f'tokenizer = AutoTokenizer.from_pretrained("{adapter_ref}")']
    imports = ["import torch", f"from transformers import {auto}, AutoTokenizer"
               + (", BitsAndBytesConfig" if quantized else "")]
    if kind != "merged":
        imports.append("from peft import PeftModel" + (", prepare_model_for_kbit_training" if quantized else ""))
    if head == "score":
        tail = ['enc = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", '
                '"content": "Hello!"}], return_tensors="pt", return_dict=True)',
                "score = model(**enc).logits[0, 0]  # one reward per conversation"]
    else:
        tail = ['enc = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}], '
                'add_generation_prompt=True, return_tensors="pt", return_dict=True)',
                "out = model.generate(**enc, max_new_tokens=64, do_sample=False)",
                'print(tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))']
    return ["## Usage", "", "```python", *imports, "", *body, *tail, "```", ""]


def portable_of(base: dict) -> dict:
    """The portable base of a lineage's ``base_model`` (recorded by this version, else derived from it)."""
    from llmtune.models.portable import portable_base

    return base.get("portable") or portable_base(base.get("name_or_path", ""), base.get("kind"), base.get("path"),
                                                 base.get("revision"))


def finalize_adapter_dir(adapter_dir: Path, lineage: dict) -> None:
    """Make a saved ``adapter/`` portable: ``adapter_config.json`` names the portable base (and revision), the
    tokenizer config loads elsewhere, and ``README.md`` is the adapter's model card with the lineage.

    Args:
        adapter_dir: the run's ``adapter/`` (peft adapter + tokenizer).
        lineage: the run's lineage (:func:`llmtune.core.runner.lineage`), with ``base_model.portable``.
    """
    from llmtune.models.portable import clean_tokenizer_config

    base = lineage["base_model"]
    portable = portable_of(base)
    for config_path in sorted(adapter_dir.glob("**/adapter_config.json")):  # PPO: adapter/value/ too
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = portable.get("name_or_path") or base.get("name_or_path")
        config["revision"] = portable.get("revision")
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    clean_tokenizer_config(adapter_dir, base.get("model_max_length"))
    (adapter_dir / "README.md").write_text(adapter_card(adapter_dir, lineage))


def adapter_card(adapter_dir: Path, lineage: dict) -> str:
    """Model card of a stage's adapter: hub front matter (real ``base_model``, license, datasets), the chain warning,
    what the base weights are, usage, data and metrics, versions."""
    base = lineage["base_model"]
    portable = portable_of(base)
    chain = lineage.get("previous_adapters", [])
    head = lineage.get("model_head", "causal_lm")
    stage = lineage.get("stage")
    full = lineage.get("adapter_type") == "none"  # full fine-tuning: adapter/ holds the whole model
    front = front_matter({
        "base_model": portable.get("name_or_path"), "library_name": "transformers" if full else "peft",
        "license": portable.get("license"),
        "datasets": hub_datasets(lineage.get("data", [])),
        "pipeline_tag": "text-classification" if head == "score" else "text-generation",
        "tags": ["llmtune", str(stage), "full-fine-tune" if full else "lora"]})
    lines = [front, f"# {Path(lineage.get('summary', {}).get('run_dir', adapter_dir.parent)).name}: llmtune {stage} "
             "adapter", "", *chain_warning(chain, stacked=bool(base.get("quantization"))), "## Base model", "",
             f"- `base_model_name_or_path`: `{portable.get('name_or_path')}`"
             + (f" (revision `{portable['revision']}`)" if portable.get("revision") else ""),
             f"- Trained against: {portable.get('weights', base.get('name_or_path'))}",
             *quantization_lines(base.get("quantization")),
             f"- Recipe name: `{base.get('name_or_path')}` ({base.get('kind')})", ""]
    lines += usage_snippet(portable, "path/to/this/model" if full else "path/to/this/adapter", head,
                           "merged" if full else "adapter", local_base=base.get("path"),
                           quantization=base.get("quantization"))
    lines += lineage_lines(lineage)
    return "\n".join(lines)


def quantization_lines(quantization: dict | None) -> list[str]:
    """Card line: how the base was quantized for training (empty when it was not)."""
    if not quantization:
        return []
    args = ", ".join(f"{k}={v}" for k, v in quantization["config"].items())
    return [f"- Quantized for training: `BitsAndBytesConfig({args})`, loaded as {quantization['dtype']}; the adapter's "
            "update is relative to those quantized weights, so load the base the same way (below)"]


def lineage_lines(lineage: dict) -> list[str]:
    """Card section: data sources with sha256, steps and key metrics, library versions and llmtune commit."""
    lines = ["## Training", ""]
    for source in lineage.get("data", []):
        lines.append(f"- Data: `{source.get('path')}` ({source.get('format', '?')}, {source.get('rows_read', '?')} "
                     f"rows), sha256 `{source.get('sha256')}`")
    summary = lineage.get("summary") or {}
    if "steps" in summary:
        lines.append(f"- Optimizer steps: {summary['steps']}")
    for when in ("eval_before", "eval_after"):
        values = {k: v for k, v in (summary.get(when) or {}).items() if isinstance(v, (int, float))
                  and not any(t in k for t in ("runtime", "per_second", "epoch"))}
        if values:
            lines.append(f"- {when}: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
    return lines + versions_lines(lineage) + [""]


def versions_lines(lineage: dict) -> list[str]:
    """Card lines: the library versions and the llmtune version/commit a run was trained with."""
    versions = lineage.get("versions") or {}
    lines = ["- Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v)] if versions else []
    return lines + [f"- llmtune {lineage.get('llmtune_version')} (commit `{lineage.get('llmtune_commit')}`)"]


def push_to_hub(folder: Path, repo_id: str, *, private: bool = True, message: str = "llmtune upload") -> str:
    """Upload a directory (adapter or merged model, with its card) to a hub model repo, creating the repo.

    Args:
        folder: the directory to upload.
        repo_id: ``org/name`` on the hub.
        private: create the repo private (an existing repo keeps its visibility).

    Returns:
        The repo URL.

    Raises:
        HubUploadError: no network/credentials or the hub refused (message says which and how to fix it).
    """
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=message)
    except Exception as err:  # noqa: BLE001 - hub client errors are many kinds; all mean "not uploaded"
        raise HubUploadError(
            f"output.push_to_hub: uploading {folder} to {repo_id} failed: {type(err).__name__}: {err}. Log in with "
            "`hf auth login` (or set HF_TOKEN), check output.hub_model_id, or set output.push_to_hub: false; "
            f"the files are kept in {folder}"
        ) from err
    log.info("uploaded %s to %s", folder, url)
    return str(url)
