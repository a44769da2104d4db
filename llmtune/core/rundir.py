"""The run directory every stage writes (see docs/getting-started.md, "The run directory"):

    runs/<name>/
      recipe.resolved.yaml   every value, inherited defaults included
      data_report.json       rows read / kept / dropped (reasons, row indices) / truncated, tokens
      metrics.jsonl          one JSON object per logging step and per eval
      plots/                 summary.png (the curves that say whether the stage works), all_metrics.png (every
                             varying series); drawn at the end
      checkpoints/checkpoint-N/  resumable state (adapter, optimizer, scheduler, RNG, data position)
      adapter/               PEFT adapter + tokenizer (with the training chat template)
      lineage.json           base model, stage, data sources with hashes, final metrics; written last

Checkpoints keep transformers' ``checkpoint-N`` naming; they are written crash-safe and only complete ones are
resumed from or rotated (:mod:`llmtune.core.checkpoint`).
``lineage.json`` is written last: its presence marks a complete run.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from llmtune.config import RecipeError
from llmtune.core import checkpoint as ck
from llmtune.utils import get_logger

RECIPE = "recipe.resolved.yaml"
DATA_REPORT = "data_report.json"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"  # PPO/GRPO: a few rollout records per iteration, each with the step it was sampled at
PLOTS = "plots"  # summary.png (the stage's chosen curves), all_metrics.png (llmtune.core.plots)
CHECKPOINTS = "checkpoints"
ADAPTER = "adapter"
LINEAGE = "lineage.json"
AUTO = "auto"  # train.resume_from: resume an unfinished run when it has a complete checkpoint, else start fresh

log = get_logger("rundir")


@dataclass
class RunDir:
    """Paths of one run directory."""

    root: Path

    def __post_init__(self):
        self.root = Path(self.root)

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    @property
    def is_complete(self) -> bool:
        """True once the stage finished and wrote its lineage."""
        return (self.root / LINEAGE).is_file()

    def latest_checkpoint(self, report: bool = False) -> Path | None:
        """Newest COMPLETE ``checkpoints/checkpoint-N`` (:mod:`llmtune.core.checkpoint`), or ``None``; with
        ``report``, partial ones newer than it are logged as skipped (they are left in place)."""
        return ck.newest_complete(self.root / CHECKPOINTS, report=report)

    def resolve_resume(self, resume_from: str | None, report: bool = True) -> Path | None:
        """Turn ``train.resume_from`` into the checkpoint to resume from (``None``: start fresh).

        ``auto``: the newest complete checkpoint of an unfinished run, else ``None`` (nothing trained yet: a fresh
        start; a finished run is refused by :meth:`check`). ``latest``: the newest complete checkpoint, which must
        exist (a finished run may be extended this way). A path: that checkpoint, which must be complete.

        Raises:
            RecipeError: ``latest`` with no complete checkpoint, or a path that is not a complete checkpoint.
        """
        if resume_from is None:
            return None
        if resume_from == AUTO:
            return None if self.is_complete else self.latest_checkpoint(report=report)
        if resume_from == "latest":
            found = self.latest_checkpoint(report=report)
            if found is None:
                _, partial = ck.scan(self.root / CHECKPOINTS)
                skipped = f" (incomplete, skipped: {', '.join(p.name for p, _ in partial)})" if partial else ""
                raise RecipeError([("train.resume_from", f"'latest' but {self.root / CHECKPOINTS} holds no complete "
                                    f"checkpoint{skipped}; set train.resume_from=auto (the default) to start fresh")])
            return found
        path = Path(resume_from)
        reason = ck.why_incomplete(path)
        if reason is not None:
            raise RecipeError([("train.resume_from", f"{path} is not a complete checkpoint directory ({reason}); "
                                f"checkpoints are under {self.root / CHECKPOINTS}")])
        return path

    def plan(self, resume_from: str | None, overwrite: bool, report: bool = True) -> Path | None:
        """The checkpoint this run resumes from (``None``: fresh), after checking the directory may be used.

        ``output.overwrite`` with ``resume_from: auto`` starts fresh (the old run is replaced).

        Raises:
            RecipeError: as :meth:`resolve_resume` and :meth:`check`.
        """
        if overwrite and resume_from == AUTO:
            resume_from = None
        found = self.resolve_resume(resume_from, report=report)
        self.check(resume=found is not None, overwrite=overwrite, resume_from=resume_from)
        return found

    def check(self, *, resume: bool, overwrite: bool, resume_from: str | None = None) -> None:
        """Everything :meth:`prepare` would refuse, without touching the disk (used by ``llmtune validate``).

        Args:
            resume: a checkpoint will be resumed from (:meth:`resolve_resume` found one).
            overwrite: ``output.overwrite``.
            resume_from: ``train.resume_from``; with ``auto`` an unfinished run that holds no complete checkpoint
                (a failed set-up, a kill before the first save) is started again.

        Raises:
            RecipeError: the path is a file or not writable, or holds another run and neither resume nor
                overwrite was asked for.
        """
        if self.root.exists() and not self.root.is_dir():
            raise RecipeError([("output.dir", f"{self.root} exists and is not a directory; pick another output.dir")])
        parent = next((p for p in (self.root, *self.root.parents) if p.exists()), Path("."))
        if not os.access(parent, os.W_OK):
            raise RecipeError([("output.dir", f"{self.root} cannot be created: {parent} is not writable")])
        holds_run = (self.root / RECIPE).exists() or (self.root / CHECKPOINTS).exists()
        if holds_run and not resume and not overwrite:
            if self.is_complete:
                hint = ("it finished (lineage.json); replace it with output.overwrite=true, pick another output.dir, "
                        "or train it further with a larger train.max_steps and train.resume_from=latest")
                raise RecipeError([("output.dir", f"{self.root} already holds a run; {hint}")])
            if resume_from != AUTO:
                hint = ("continue it with train.resume_from=auto" if self.latest_checkpoint() is not None else
                        "it holds no complete checkpoint: start it again with train.resume_from=auto")
                raise RecipeError([("output.dir", f"{self.root} already holds a run; {hint}, replace it with "
                                    "output.overwrite=true, or pick another output.dir")])
        if self.root.exists() and any(self.root.iterdir()) and not holds_run and not resume:
            raise RecipeError([("output.dir", f"{self.root} is not empty and is not a run directory; pick another "
                                "output.dir")])

    def check_resume_recipe(self, recipe_dump: dict) -> None:
        """Refuse to resume with settings that change what is trained (batch, lr, data, model, adapter...).

        Keys that only extend or observe a run may change: ``train.max_steps``, ``num_epochs``, ``*_steps`` of
        eval/save/logging, ``resume_from``, ``save_total_limit``, ``eval_batch_size``, ``output.*``, a node's
        rank/master address/port, ``ppo.sample_every`` / ``grpo.sample_every``, and what changes how but not what
        is computed: ``train.gradient_checkpointing``, ``data.num_proc``, ``data.cache``, ``data.cache_dir``.

        Raises:
            RecipeError: one problem per changed key, with its old and new value.
        """
        import yaml

        path = self.root / RECIPE
        if not path.is_file():
            return
        old = yaml.safe_load(path.read_text()) or {}
        free = {"train.max_steps", "train.num_epochs", "train.eval_steps", "train.save_steps", "train.logging_steps",
                "train.resume_from", "train.save_total_limit", "train.eval_batch_size", "train.eval_at_start",
                "train.early_stopping_patience", "train.dataloader_num_workers", "train.max_nonfinite_steps",
                # how, not what: recomputation gives the same gradients; tokenization processes and its cache
                "train.gradient_checkpointing", "data.num_proc", "data.cache", "data.cache_dir",
                # where this process sits in the job (differs per node of one job), what PPO writes as samples
                "distributed.node_rank", "distributed.master_addr", "distributed.master_port", "ppo.sample_every",
                "grpo.sample_every"}
        # which rollout engine samples, and where it runs, may change (a rollout server that died comes back at
        # another url, or the run continues with hf): the policy sampled from is the same
        free |= {"rollout.engine", "rollout.vllm.mode", "rollout.vllm.url", "rollout.vllm.startup_timeout_s",
                 "rollout.vllm.request_timeout_s", "rollout.vllm.gpu_memory_utilization",
                 "rollout.vllm.enable_sleep_mode", "rollout.vllm.secret_file",
                 "rollout.vllm.tensor_parallel_size"}
        problems = []
        for section, values in recipe_dump.items():
            if section == "output" or not isinstance(values, dict):
                continue
            flat = []  # (key, value before, value now); one nested level (rollout.vllm.*) compared key by key
            for key, value in values.items():
                if isinstance(value, dict) and key == "vllm":
                    before = (old.get(section) or {}).get(key) or {}
                    flat += [(f"{key}.{k}", before.get(k, v), v) for k, v in value.items()]
                else:
                    flat.append((key, (old.get(section) or {}).get(key, value), value))
            for key, before, value in flat:
                dotted = f"{section}.{key}"
                if dotted not in free and before != value:
                    problems.append((dotted, f"was {before!r} in the interrupted run, now {value!r}; resuming "
                                     "must keep it (or start a new run with output.overwrite=true)"))
        if problems:
            raise RecipeError(problems)

    def prepare(self, *, resume: bool, overwrite: bool, resume_from: str | None = None) -> None:
        """Create the directory, refusing to mix two runs in one place (see :meth:`check`).

        ``output.overwrite`` removes the old run. ``auto`` in an unfinished run without a complete checkpoint starts
        again: the files of the earlier attempt (recipe, data report, metrics, plot) are replaced, partial
        checkpoints are left in place and reported.

        Raises:
            RecipeError: as :meth:`check`.
        """
        self.check(resume=resume, overwrite=overwrite, resume_from=resume_from)
        holds_run = (self.root / RECIPE).exists() or (self.root / CHECKPOINTS).exists()
        if holds_run and not resume and overwrite:
            shutil.rmtree(self.root)
        elif holds_run and not resume:
            old = [name for name in (RECIPE, DATA_REPORT, METRICS, PLOTS) if (self.root / name).exists()]
            log.warning("%s holds an earlier attempt that trained nothing it could keep (no complete checkpoint): "
                        "starting again%s", self.root, f"; replacing its {', '.join(old)}" if old else "")
            ck.newest_complete(self.root / CHECKPOINTS, report=True)
            for name in old:
                shutil.rmtree(self.root / name) if name == PLOTS else (self.root / name).unlink()
        self.root.mkdir(parents=True, exist_ok=True)
        if not resume:
            for name in (METRICS, LINEAGE):
                (self.root / name).unlink(missing_ok=True)
