"""Validation that reports ALL problems of a recipe at once, each with its dotted path.

Field errors come from pydantic (types, ranges, unknown keys — the latter with a "did you mean");
cross-field rules are checked on the raw mapping so they are reported even when some fields are
invalid too.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from llmtune.config.schema import Recipe, default_max_new_tokens
from llmtune.config.surface import surface_problems
from llmtune.errors import LlmtuneError
from llmtune.utils import dotted_get


class RecipeError(LlmtuneError, ValueError):
    """A recipe has one or more problems.

    Attributes:
        problems: ``[(dotted_path, message), ...]`` in the order found.
        source: the recipe file, when there is one.
    """

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(problems)} problem(s){where}:"]
        lines += [f"  - {path or '<recipe>'}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


def _field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (sub)model that the location ``loc`` (without its last element) points into."""
    cls: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        candidates = [ann, *args]
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if cls is None:
            return []
    return list(getattr(cls, "model_fields", {}))


def _all_field_names(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """``{leaf_name: dotted_path}`` for every field of every section (for 'belongs in section X' hints)."""
    out: dict[str, str] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_all_field_names(ann, f"{prefix}{name}."))
        else:
            out.setdefault(name, f"{prefix}{name}")
    return out


_UNION_TAG = re.compile(r"^(bool|int|float|str|none|literal\[.*\]|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _strip_union_tags(errors: list[dict]) -> list[dict]:
    """Drop the member tags pydantic appends to the location of each failed member of a union (``bool``,
    ``literal['auto']``, ``list[str]`` ...): the user's key is the field, not a Python type."""
    out = []
    for err in errors:
        loc = list(err["loc"])
        while len(loc) > 1 and isinstance(loc[-1], str) and _UNION_TAG.match(loc[-1]):
            loc.pop()
        out.append({**err, "loc": tuple(loc)})
    return out


def _merge_union_errors(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One problem per key: the messages of a union's failed members joined with "or"."""
    merged: dict[str, list[str]] = {}
    for key, message in problems:
        merged.setdefault(key, []).append(message)
    return [(key, messages[0] if len(messages) == 1 else "; or ".join(messages)) for key, messages in merged.items()]


# keys that moved to another section: `old.path: new.path` (the error names the new key)
MOVED_KEYS: dict[str, str] = {
    f"{stage}.{key}": f"rollout.{key}"
    for stage in ("ppo", "grpo")
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "eval_max_new_tokens")
}


def _format_pydantic(err: dict) -> tuple[str, str]:
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden" and path in MOVED_KEYS:
        new = MOVED_KEYS[path]
        section, key = new.split(".", 1)
        return path, (f"{path} moved to {new} (PPO and GRPO share one `{section}:` section for sampling); write "
                      f"`{section}: {{{key}: {err.get('input')!r}}}` or the override {new}=...")
    if err["type"] == "extra_forbidden":
        key = str(loc[-1])
        names = _field_names(Recipe, loc)
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        if close:
            return path, f"unknown key; did you mean {close[0]!r}?"
        elsewhere = _all_field_names(Recipe).get(key)
        if elsewhere:
            return path, f"unknown key here; {key!r} belongs in {elsewhere!r}"
        return path, f"unknown key; valid keys here: {', '.join(names)}"
    msg = err["msg"]
    value = err.get("input")
    numeric = err["type"] in ("int_type", "float_type", "int_from_float")
    if numeric and isinstance(value, bool):
        return path, (f"{msg}, got the boolean {value!r} (YAML reads yes/no/on/off/true/false as booleans); write a "
                      "number, e.g. 2.0e-4 or 8")
    if numeric and isinstance(value, str):
        return path, f"{msg}, got the string {value!r}; write a plain number without quotes (e.g. 2.0e-4 or 8)"
    if err["type"] == "finite_number":
        return path, (f"{msg}, got {value!r} (a YAML number too large for a float, such as 1.0e+400, reads as "
                      "inf); write a finite number")
    if err["type"] in ("string_type", "bool_type") and value is not None:
        want = "a string (quote it)" if err["type"] == "string_type" else "a boolean (true or false)"
        return path, f"{msg}: expected {want}, got {value!r} of type {type(value).__name__}"
    if "input" in err and err["type"] not in ("missing",):
        msg = f"{msg} (got {err['input']!r})"
    return path, msg


def cross_field_problems(doc: dict) -> list[tuple[str, str]]:
    """Conflicts between fields, checked on the raw mapping so they show up beside field errors."""
    problems: list[tuple[str, str]] = []
    if dotted_get(doc, "precision.fp16") is True and dotted_get(doc, "precision.bf16") is True:
        problems.append(("precision.fp16", "fp16 and bf16 are both on; choose one (precision.bf16 is preferred on Ampere+)"))
    if "name_or_path" in (doc.get("model") or {}) and dotted_get(doc, "model.name_or_path") is None \
            and not dotted_get(doc, "model.from_run"):
        problems.append(("model.name_or_path", "null means 'the base that model.from_run recorded', but "
                         "model.from_run is not set: name a base model (a local directory, a hub id, a .gguf file "
                         "or builtin:smollm2-135m-instruct) or set model.from_run"))
    four, eight = dotted_get(doc, "model.load_in_4bit") is True, dotted_get(doc, "model.load_in_8bit") is True
    if four and eight:
        problems.append(("model.load_in_8bit", "load_in_4bit and load_in_8bit are both on; choose one"))
    if (four or eight) and dotted_get(doc, "adapter.type", "lora") == "none":
        problems.append(
            ("adapter.type", "a quantized base (QLoRA / 8-bit) cannot be trained without an adapter; set adapter.type: lora")
        )
    model_dtype = dotted_get(doc, "model.dtype", "auto")
    if dotted_get(doc, "precision.fp16") is True and model_dtype == "bf16":
        problems.append(("model.dtype", "bf16 weights with fp16 mixed precision; use model.dtype: fp16 or auto"))
    if dotted_get(doc, "precision.bf16") is True and model_dtype == "fp16":
        problems.append(("model.dtype", "fp16 weights with bf16 mixed precision; use model.dtype: bf16 or auto"))
    if model_dtype in ("fp16", "bf16") and dotted_get(doc, "adapter.type", "lora") == "none" and not (
        dotted_get(doc, "precision.fp16") or dotted_get(doc, "precision.bf16")
    ):
        problems.append(("model.dtype", f"full fine-tuning with {model_dtype} weights needs precision.{model_dtype}: true"))
    micro, glob = dotted_get(doc, "train.micro_batch_size", 1), dotted_get(doc, "train.global_batch_size", 8)
    if isinstance(micro, int) and isinstance(glob, int) and micro > 0 and glob > 0 and glob % micro:
        problems.append(
            ("train.global_batch_size", f"must be a multiple of micro_batch_size ({micro}); got {glob}")
        )
    val = dotted_get(doc, "data.val_size", 0)
    if isinstance(val, (int, float)) and val >= 1 and float(val) != int(val):
        problems.append(("data.val_size", f"a fraction must be < 1 and a count an integer; got {val}"))
    if dotted_get(doc, "distributed.deepspeed") and dotted_get(doc, "distributed.zero_stage") is not None:
        problems.append(("distributed.zero_stage", "set either distributed.deepspeed (a config file) or zero_stage, not both"))
    if dotted_get(doc, "train.eval_steps") and not dotted_get(doc, "data.val_size"):
        problems.append(("train.eval_steps", "evaluation needs a validation split: set data.val_size (a fraction "
                         "or a row count)"))
    if dotted_get(doc, "train.early_stopping_patience") and not dotted_get(doc, "data.val_size"):
        problems.append(("train.early_stopping_patience", "early stopping needs a validation split (data.val_size > 0)"))
    if dotted_get(doc, "stage") == "ppo":
        problems += ppo_problems(doc)
    if dotted_get(doc, "stage") == "grpo":
        problems += grpo_problems(doc)
    if dotted_get(doc, "stage") in ("ppo", "grpo"):
        problems += rollout_problems(doc)
        if dotted_get(doc, "adapter.type", "lora") == "none":  # the trainer refuses it when it builds the model
            kept = "the policy, its reference and the value model" if dotted_get(doc, "stage") == "ppo" else \
                "the policy and its reference"
            problems.append(("adapter.type", f"{dotted_get(doc, 'stage')} keeps {kept} on one base as LoRA adapters "
                             "(the reference is the policy with its adapter off); full fine-tuning (adapter.type: "
                             "none) has no adapter to switch off. Set adapter.type: lora"))
    problems += agent_problems(doc)
    problems += distributed_problems(doc)
    problems += surface_problems(doc)  # report_to, optim, schedules, extra_args, push_to_hub
    datasets = dotted_get(doc, "data.datasets")
    if isinstance(datasets, list) and not datasets:
        problems.append(("data.datasets", "at least one data source is needed"))
    for i, ds in enumerate(datasets if isinstance(datasets, list) else []):
        if isinstance(ds, dict) and isinstance(ds.get("columns"), dict):
            problems += column_key_problems(ds["columns"], f"data.datasets.{i}")
    return problems


# Every canonical field a ``data.datasets[i].columns`` mapping may name: the union of the fields of the data formats
# (llmtune.data.formats.FORMAT_FIELDS; a test keeps the two equal). Checked here, before any data is read.
CANONICAL_COLUMNS = ("chosen", "completion", "content", "input", "instruction", "label", "messages", "output",
                     "prompt", "reference", "rejected", "role", "system", "text", "tools")


def column_key_problems(columns: dict, key: str) -> list[tuple[str, str]]:
    """Keys of a ``columns`` mapping (canonical field -> column of the file) that are no canonical field, as
    ``(f"{key}.columns.<name>", message)`` with a did-you-mean, or the hint that the mapping looks reversed."""
    problems = []
    for name, column in columns.items():
        if name in CANONICAL_COLUMNS:
            continue
        if column in CANONICAL_COLUMNS:
            fix = f"the mapping goes canonical field -> your column: write {{{column}: {name}}}"
        else:
            close = difflib.get_close_matches(str(name), CANONICAL_COLUMNS, n=1, cutoff=0.6)
            fix = (f"did you mean {close[0]!r} ({{{close[0]}: {column}}})?" if close
                   else f"map a canonical field to your column, e.g. {{instruction: {column}}}")
        problems.append((f"{key}.columns.{name}", f"{name!r} is not a canonical field; {fix} (canonical fields: "
                         f"{', '.join(CANONICAL_COLUMNS)})"))
    return problems


def _zero_stage(doc: dict) -> int | None:
    """ZeRO stage of a raw recipe: distributed.zero_stage, or zero_optimization.stage of a readable config file."""
    path = dotted_get(doc, "distributed.deepspeed")
    if not isinstance(path, str):
        stage = dotted_get(doc, "distributed.zero_stage")
        return stage if isinstance(stage, int) else None
    import json
    from pathlib import Path

    try:  # a missing or broken file is reported when the run starts (llmtune.core.distributed.deepspeed_config)
        stage = json.loads(Path(path).expanduser().read_text()).get("zero_optimization", {}).get("stage", 0)
    except (OSError, ValueError, AttributeError):
        return None
    return stage if isinstance(stage, int) else None


def distributed_problems(doc: dict) -> list[tuple[str, str]]:
    """Launch keys and what ZeRO-3 cannot do: 8-bit bases, a 4-bit storage dtype that DeepSpeed would cast
    (bitsandbytes #1249; peft's DeepSpeed guide), reference log-probs computed before the engine exists."""
    problems: list[tuple[str, str]] = []
    nnodes, node_rank = dotted_get(doc, "distributed.nnodes", 1), dotted_get(doc, "distributed.node_rank", 0)
    if isinstance(nnodes, int) and isinstance(node_rank, int) and node_rank >= nnodes >= 1:
        problems.append(("distributed.node_rank", f"{node_rank} is not below nnodes ({nnodes}); node ranks are "
                         f"0..{nnodes - 1}"))
    nproc, micro = dotted_get(doc, "distributed.nproc_per_node"), dotted_get(doc, "train.micro_batch_size", 1)
    glob = dotted_get(doc, "train.global_batch_size", 8)
    if all(isinstance(v, int) and v > 0 for v in (nproc or 1, nnodes, micro, glob)):
        per_step = micro * (nproc or 1) * nnodes
        if per_step > micro and glob % per_step:  # one process: the micro_batch_size rule above
            problems.append(("train.global_batch_size", f"{glob} is not a multiple of micro_batch_size ({micro}) x "
                             f"processes ({nproc or 1} per node x {nnodes} nodes) = {per_step}"))
    if _zero_stage(doc) != 3:
        return problems
    if dotted_get(doc, "model.load_in_8bit") is True:
        problems.append(("model.load_in_8bit", "ZeRO-3 cannot partition bitsandbytes 8-bit weights; use "
                         "model.load_in_4bit (QLoRA) or ZeRO stage 2"))
    if dotted_get(doc, "model.load_in_4bit") is True:
        train_dtype = "bf16" if dotted_get(doc, "precision.bf16") is True else "fp16" if dotted_get(doc, "precision.fp16") is True \
            else "fp32"
        model_dtype = dotted_get(doc, "model.dtype", "auto")
        if model_dtype not in ("auto", train_dtype):
            problems.append(("model.dtype", f"QLoRA + ZeRO-3 stores the 4-bit weights in the model dtype "
                             f"(bnb_4bit_quant_storage), and DeepSpeed casts every parameter to the training dtype "
                             f"{train_dtype}; model.dtype {model_dtype} would be cast and the packed 4-bit data "
                             f"destroyed. Set model.dtype: {train_dtype} (or auto)"))
    if dotted_get(doc, "dpo.precompute_ref_logps") is True and dotted_get(doc, "stage") in (None, "dpo"):
        problems.append(("dpo.precompute_ref_logps", "with ZeRO-3 the weights are partitioned before training "
                         "starts, so reference log-probs cannot be computed ahead; set it to false (the reference "
                         "is the policy with its adapter disabled) or use ZeRO stage 2"))
    return problems


def rollout_problems(doc: dict, engine: str | None = None) -> list[tuple[str, str]]:
    """Server mode without its url (engine vllm or auto), and what the vLLM rollout engine cannot sample for
    (engine vllm; see ``RolloutConfig``).

    vLLM receives the policy as a LoRA adapter after every optimizer step, on top of a rollout base that is the
    frozen model below the adapter (issue 22). So it refuses full fine-tuning (every weight would have to be sent
    and loaded each step), a quantized base (the trainer's policy is the 4-/8-bit base + adapter; the engine's base
    would be other weights, so it would sample from another policy: off-policy by construction, not the small
    numerical mismatch the capped importance correction is for), DoRA and ``modules_to_save`` (not in vLLM's
    LoRA), ZeRO-3 (the adapter is partitioned over ranks) and an engine LoRA rank below the adapter's.

    Args:
        doc: the raw recipe mapping. engine: check as if ``rollout.engine`` were this (``auto`` selection asks with
            ``vllm``); default the recipe's own.
    """
    engine = engine or dotted_get(doc, "rollout.engine", "auto")
    problems: list[tuple[str, str]] = []
    if engine != "hf" and dotted_get(doc, "rollout.vllm.mode", "colocate") == "server" and not dotted_get(doc, "rollout.vllm.url"):
        problems.append(("rollout.vllm.url", "rollout.vllm.mode: server needs the address of a running rollout "
                         "server, e.g. rollout.vllm.url: http://127.0.0.1:8000 (start one with `llmtune "
                         "rollout-server RECIPE`, which prints it), or use mode: colocate"))
    staleness = dotted_get(doc, "rollout.max_staleness", 0)
    if isinstance(staleness, int) and staleness > 0:
        if engine == "hf":
            problems.append(("rollout.max_staleness", f"{staleness} samples the next rollout batches while the trainer "
                             "trains, which needs an engine in another process: the hf engine samples on the training "
                             "model itself. Use rollout.engine: vllm (colocate or server), or max_staleness: 0"))
        if dotted_get(doc, "grpo.dynamic_sampling", "off") == "resample":
            problems.append(("rollout.max_staleness", "asynchronous rollouts with grpo.dynamic_sampling: resample "
                             "(its extra rounds sample from the current policy in the middle of an iteration): use "
                             "dynamic_sampling: filter, or max_staleness: 0"))
        if dotted_get(doc, "rollout.vllm.importance_sampling_correction", True) is False:
            problems.append(("rollout.max_staleness", "asynchronous rollouts are sampled from an older policy; without "
                             "rollout.vllm.importance_sampling_correction the loss would treat them as on-policy. Set "
                             "it to true, or max_staleness: 0"))
    tp = dotted_get(doc, "rollout.vllm.tensor_parallel_size", 1)
    if engine != "hf" and isinstance(tp, int) and tp > 1 and dotted_get(doc, "rollout.vllm.mode", "colocate") != "server":
        problems.append(("rollout.vllm.tensor_parallel_size", f"{tp} GPUs per engine needs a rollout server of its own "
                         "(rollout.vllm.mode: server, started with `llmtune rollout-server RECIPE` on the rollout "
                         "node); a colocated engine shares its trainer rank's one device: set it to 1"))
    model_len, needed = dotted_get(doc, "rollout.vllm.max_model_len"), _rollout_sequence_tokens(doc)
    if engine != "hf" and isinstance(model_len, int) and needed is not None and model_len < needed[0]:
        problems.append(("rollout.vllm.max_model_len", f"{model_len} tokens is below the longest sequence this run "
                         f"asks the engine for: {needed[1]} = {needed[0]} tokens (vLLM would refuse such a request after "
                         f"its start, or cut the completion). Set it >= {needed[0]} or null (= that sum), or lower "
                         "data.max_prompt_length / rollout.max_new_tokens"))
    if engine != "vllm":
        return problems
    alternative = "or use rollout.engine: hf (transformers' generate on the training model)"
    if dotted_get(doc, "adapter.type", "lora") == "none":
        problems.append(("rollout.engine", "vllm samples with the trained LoRA adapter, pushed to the engine after "
                         "every optimizer step; full fine-tuning (adapter.type: none) would have to send and reload "
                         f"every weight of the model each step. Use adapter.type: lora, {alternative}"))
    for key, what in (("model.load_in_4bit", "4-bit (QLoRA)"), ("model.load_in_8bit", "8-bit")):
        if dotted_get(doc, key) is True:
            problems.append(("rollout.engine", f"vllm with a {what} base ({key}: true): the trained policy is the "
                             "quantized base + adapter, but the engine serves other base weights, so it would "
                             "sample from another policy (off-policy by construction, beyond what the importance "
                             f"correction is for). Train LoRA on the unquantized base ({key}: false), {alternative}"))
    if dotted_get(doc, "adapter.use_dora") is True:
        problems.append(("rollout.engine", f"vllm has no DoRA adapters (adapter.use_dora: true): use plain LoRA, "
                         f"{alternative}"))
    if dotted_get(doc, "adapter.modules_to_save"):
        problems.append(("rollout.engine", "vllm's LoRA cannot load fully trained modules (adapter.modules_to_save): "
                         f"leave it empty, {alternative}"))
    if _zero_stage(doc) == 3:
        problems.append(("rollout.engine", "vllm reads the whole policy adapter after every step; ZeRO-3 partitions "
                         f"it over the ranks: use distributed.zero_stage 2, {alternative}"))
    rank, lora_r = dotted_get(doc, "rollout.vllm.max_lora_rank"), dotted_get(doc, "adapter.lora_r", 16)
    if isinstance(rank, int) and isinstance(lora_r, int) and rank < lora_r:
        problems.append(("rollout.vllm.max_lora_rank", f"{rank} is below the trained adapter's rank adapter.lora_r "
                         f"= {lora_r}: the engine would refuse the adapter; set it >= {lora_r} or null (= lora_r)"))
    return problems


def _rollout_sequence_tokens(doc: dict) -> tuple[int, str] | None:
    """The longest prompt + completion an online-RL run samples, ``(tokens, "how it adds up")``, from the raw
    recipe (None when a value is not an int: reported as a field error)."""
    prompt_key = "data.max_prompt_length" if dotted_get(doc, "data.max_prompt_length") is not None else "data.max_length"
    prompt = dotted_get(doc, prompt_key, 1024)
    new = dotted_get(doc, "rollout.max_new_tokens")
    if new is None:
        agent = bool(dotted_get(doc, "agent.tools")) or bool(dotted_get(doc, "agent.environment"))
        new = default_max_new_tokens(dotted_get(doc, "stage"), agent)
    evaluation = dotted_get(doc, "rollout.eval_max_new_tokens")
    if not all(isinstance(v, int) for v in (prompt, new)) or not isinstance(evaluation, (int, type(None))):
        return None
    longest, key = (evaluation, "rollout.eval_max_new_tokens") if evaluation and evaluation > new \
        else (new, "rollout.max_new_tokens")
    return prompt + longest, f"{prompt_key} {prompt} + {key} {longest}"


def agent_problems(doc: dict) -> list[tuple[str, str]]:
    """Multi-turn rollouts (``agent:``): only for the online-RL stages, and a tool result that fits the budget."""
    enabled = bool(dotted_get(doc, "agent.tools")) or bool(dotted_get(doc, "agent.environment"))
    if not enabled:
        return []
    stage = dotted_get(doc, "stage")
    if stage is not None and stage not in ("ppo", "grpo"):
        return [("agent", f"multi-turn tool rollouts are sampled by the online-RL stages (ppo, grpo); stage {stage} "
                 "trains on fixed data: remove the agent section")]
    problems = []
    budget = dotted_get(doc, "rollout.max_new_tokens")
    budget = default_max_new_tokens(stage, True) if budget is None else budget
    cap = dotted_get(doc, "agent.max_tool_result_tokens")  # null = a quarter of the budget: always fits
    if isinstance(budget, int) and isinstance(cap, int) and cap >= budget:
        problems.append(("agent.max_tool_result_tokens", f"{cap} is not below rollout.max_new_tokens ({budget}), the "
                         "budget of the WHOLE trajectory (every sampled turn, tool result and template token after the "
                         f"prompt): one tool result would use it all; lower it or raise rollout.max_new_tokens"))
    return problems


def overlong_problems(doc: dict, stage: str) -> list[tuple[str, str]]:
    """``<stage>.overlong_buffer_tokens`` fits in ``rollout.max_new_tokens``."""
    buffer, longest = dotted_get(doc, f"{stage}.overlong_buffer_tokens"), dotted_get(doc, "rollout.max_new_tokens")
    agent = bool(dotted_get(doc, "agent.tools")) or bool(dotted_get(doc, "agent.environment"))
    longest = default_max_new_tokens(stage, agent) if longest is None else longest
    if isinstance(buffer, int) and isinstance(longest, int) and buffer > longest:
        return [(f"{stage}.overlong_buffer_tokens", f"{buffer} is more than rollout.max_new_tokens ({longest}): the "
                 "penalty window lies inside the completion length; use at most max_new_tokens (DAPO: 4096 of "
                 "20480)")]
    return []


def ppo_problems(doc: dict) -> list[tuple[str, str]]:
    """PPO's batch arithmetic and reward source (see ``PPOConfig``)."""
    problems: list[tuple[str, str]] = overlong_problems(doc, "ppo")
    has_run = bool(dotted_get(doc, "reward.from_run"))
    has_fn = bool(dotted_get(doc, "reward.function")) or bool(dotted_get(doc, "reward.functions"))
    if has_run == has_fn:
        problems.append(("reward", "PPO needs exactly one score source: reward.from_run (an `llmtune rm` run) or "
                         "reward.function (module:function, e.g. llmtune.rewards:gsm8k_reward) / reward.functions"))
    rollout, glob = dotted_get(doc, "ppo.rollout_batch_size", 16), dotted_get(doc, "train.global_batch_size", 8)
    epochs = dotted_get(doc, "ppo.ppo_epochs", 2)
    if not all(isinstance(v, int) and v > 0 for v in (rollout, glob, epochs)):
        return problems
    if rollout % glob:
        problems.append(("ppo.rollout_batch_size", f"must be a multiple of train.global_batch_size ({glob}: rollouts "
                         f"per optimizer step); got {rollout}"))
        return problems
    return problems + _iteration_problems(doc, "PPO", epochs * rollout // glob,
                                          f"ppo_epochs {epochs} x rollout_batch_size {rollout} / global_batch_size {glob}")


def grpo_problems(doc: dict) -> list[tuple[str, str]]:
    """GRPO's reward sources and batch arithmetic (see ``GRPOConfig``): whole groups in every rollout batch and
    optimizer step, whole optimizer steps in every rollout batch, steps/saves/evals at iteration ends."""
    problems: list[tuple[str, str]] = []
    functions = dotted_get(doc, "reward.functions") or []
    if not (dotted_get(doc, "reward.from_run") or dotted_get(doc, "reward.function") or functions):
        problems.append(("reward", "GRPO needs at least one reward source: reward.function (module:function, e.g. "
                         "llmtune.rewards:gsm8k_reward), reward.functions ([{function, weight}, ...]) and/or "
                         "reward.from_run (an `llmtune rm` run)"))
    if dotted_get(doc, "rollout.top_k") == 1:
        problems.append(("rollout.top_k", "1 samples the most likely token every time (greedy), so the "
                         "grpo.num_generations completions of a prompt are identical, every group's rewards are "
                         "equal and every advantage is 0: GRPO would train nothing. Use top_k: 0 (off) or >= 2 "
                         "(e.g. 50)"))
    estimator = dotted_get(doc, "grpo.advantage_estimator", "grpo")
    scale = dotted_get(doc, "grpo.scale_rewards")
    if estimator in ("rloo", "reinforce_plus_plus") and scale not in (None, "group", True):
        problems.append(("grpo.scale_rewards", f"{scale!r} applies to advantage_estimator grpo only; {estimator} has "
                         "its own normalisation (rloo: none, reinforce_plus_plus: the rollout batch's std): remove "
                         "the key"))
    problems += overlong_problems(doc, "grpo")
    group, rollout = dotted_get(doc, "grpo.num_generations", 4), dotted_get(doc, "grpo.rollout_batch_size", 16)
    glob, mu = dotted_get(doc, "train.global_batch_size", 8), dotted_get(doc, "grpo.num_iterations", 1)
    if not all(isinstance(v, int) and v > 0 for v in (group, rollout, glob, mu)):
        return problems
    if glob % group:
        problems.append(("train.global_batch_size", f"must be a multiple of grpo.num_generations ({group}: the "
                         f"completions of one prompt); got {glob}"))
    if rollout % glob:
        problems.append(("grpo.rollout_batch_size", f"must be a multiple of train.global_batch_size ({glob}: "
                         f"completions per optimizer step); got {rollout}"))
        return problems
    return problems + _iteration_problems(doc, "GRPO", mu * rollout // glob,
                                          f"num_iterations {mu} x rollout_batch_size {rollout} / global_batch_size {glob}")


def _iteration_problems(doc: dict, stage: str, per_iter: int, formula: str) -> list[tuple[str, str]]:
    """Online RL (PPO, GRPO) counts ``train.max_steps``/``save_steps``/``eval_steps`` in optimizer steps that must end
    an iteration (one rollout batch = ``per_iter`` optimizer steps, ``formula`` says why); max_steps is required."""
    problems: list[tuple[str, str]] = []
    if dotted_get(doc, "train.max_steps") is None:
        problems.append(("train.max_steps", f"{stage} needs max_steps (optimizer steps; one iteration = {per_iter} "
                         f"steps = {formula})"))
    for key in ("train.max_steps", "train.save_steps", "train.eval_steps"):
        value = dotted_get(doc, key)
        if isinstance(value, int) and value % per_iter:
            problems.append((key, f"must be a multiple of {per_iter} optimizer steps (one {stage} iteration = "
                             f"{formula}); got {value}, try {max(per_iter, round(value / per_iter) * per_iter)}"))
    return problems


def data_size_problems(recipe: Recipe, n_train: int) -> list[tuple[str, str]]:
    """Batch sizes that the training rows cannot fill (once the data is read): the global batch (PPO: the rollout
    batch of prompts) must not exceed the number of training rows."""
    if recipe.stage == "ppo":
        if recipe.ppo.rollout_batch_size > n_train:
            return [("ppo.rollout_batch_size", f"{recipe.ppo.rollout_batch_size} prompts per PPO iteration but the data "
                     f"has only {n_train} training prompts; lower ppo.rollout_batch_size (and train.global_batch_size) "
                     "or add prompts")]
        return []
    if recipe.stage == "grpo":
        prompts = recipe.grpo.rollout_batch_size // recipe.grpo.num_generations
        if prompts > n_train:
            return [("grpo.rollout_batch_size", f"{recipe.grpo.rollout_batch_size} completions = {prompts} prompts per "
                     f"iteration but the data has only {n_train} training prompts; lower grpo.rollout_batch_size or "
                     "add prompts")]
        return []
    if recipe.train.global_batch_size > n_train:
        return [("train.global_batch_size", f"{recipe.train.global_batch_size} samples per optimizer step but the "
                 f"data has only {n_train} training rows (after the validation split and dropped rows); lower "
                 f"train.global_batch_size to at most {n_train} (a multiple of micro_batch_size) or add data")]
    return []


def validate_recipe(doc: dict, source: str | None = None) -> Recipe:
    """Validate a raw recipe mapping into a :class:`Recipe`.

    Raises:
        RecipeError: all field and cross-field problems together.
    """
    problems: list[tuple[str, str]] = []
    recipe = None
    try:
        recipe = Recipe.model_validate(doc)
    except ValidationError as exc:
        problems += _merge_union_errors([_format_pydantic(e) for e in _strip_union_tags(exc.errors())])
    problems += cross_field_problems(doc)
    if problems:
        raise RecipeError(problems, source=source)
    assert recipe is not None
    return recipe
