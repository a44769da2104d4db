"""The run directory every stage writes (see DESIGN.md):

    runs/<name>/
      recipe.resolved.yaml   every value, inherited defaults included
      data_report.json       rows read / kept / dropped (reasons, row indices) / truncated, tokens
      metrics.jsonl          one JSON object per logging step and per eval
      loss.png               train/eval loss curves, drawn at the end
      checkpoints/checkpoint-N/  resumable state (adapter, optimizer, scheduler, RNG, data position)
      adapter/               PEFT adapter + tokenizer (with the training chat template)
      lineage.json           base model, stage, data sources with hashes, final metrics; written last

Checkpoints keep transformers' ``checkpoint-N`` naming so that its resume and rotation logic applies.
``lineage.json`` is written last: its presence marks a complete run.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

from llmtune.config import RecipeError

RECIPE = "recipe.resolved.yaml"
DATA_REPORT = "data_report.json"
METRICS = "metrics.jsonl"
LOSS_PLOT = "loss.png"
CHECKPOINTS = "checkpoints"
ADAPTER = "adapter"
LINEAGE = "lineage.json"


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

    def latest_checkpoint(self) -> Path | None:
        """Newest ``checkpoints/checkpoint-N`` directory, or ``None``."""
        ckpt = self.root / CHECKPOINTS
        found = get_last_checkpoint(str(ckpt)) if ckpt.is_dir() else None
        return Path(found) if found else None

    def resolve_resume(self, resume_from: str | None) -> Path | None:
        """Turn ``train.resume_from`` (a path or ``latest``) into a checkpoint directory.

        Raises:
            RecipeError: ``latest`` with no checkpoint, or a path that is not a checkpoint directory.
        """
        if resume_from is None:
            return None
        if resume_from == "latest":
            found = self.latest_checkpoint()
            if found is None:
                raise RecipeError([("train.resume_from", f"'latest' but {self.root / CHECKPOINTS} holds no checkpoint-N "
                                    "directory; remove resume_from to start fresh")])
            return found
        path = Path(resume_from)
        if not (path / "trainer_state.json").is_file():
            raise RecipeError([("train.resume_from", f"{path} is not a checkpoint directory (no trainer_state.json); "
                                f"checkpoints are under {self.root / CHECKPOINTS}")])
        return path

    def check(self, *, resume: bool, overwrite: bool) -> None:
        """Everything :meth:`prepare` would refuse, without touching the disk (used by ``llmtune validate``).

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
            hint = ("it is complete (lineage.json); replace it with output.overwrite=true or pick another output.dir"
                    if self.is_complete else "continue it with train.resume_from=latest, replace it with "
                    "output.overwrite=true, or pick another output.dir")
            raise RecipeError([("output.dir", f"{self.root} already holds a run; {hint}")])
        if self.root.exists() and any(self.root.iterdir()) and not holds_run and not resume:
            raise RecipeError([("output.dir", f"{self.root} is not empty and is not a run directory; pick another "
                                "output.dir")])

    def check_resume_recipe(self, recipe_dump: dict) -> None:
        """Refuse to resume with settings that change what is trained (batch, lr, data, model, adapter...).

        Keys that only extend or observe a run may change: ``train.max_steps``, ``num_epochs``, ``*_steps`` of
        eval/save/logging, ``resume_from``, ``save_total_limit``, ``eval_batch_size``, ``output.*``, a node's
        rank/master address/port and ``ppo.sample_every`` / ``grpo.sample_every``.

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
                # where this process sits in the job (differs per node of one job), what PPO writes as samples
                "distributed.node_rank", "distributed.master_addr", "distributed.master_port", "ppo.sample_every",
                "grpo.sample_every"}
        problems = []
        for section, values in recipe_dump.items():
            if section == "output" or not isinstance(values, dict):
                continue
            for key, value in values.items():
                dotted = f"{section}.{key}"
                before = (old.get(section) or {}).get(key, value)
                if dotted not in free and before != value:
                    problems.append((dotted, f"was {before!r} in the interrupted run, now {value!r}; resuming "
                                     "must keep it (or start a new run with output.overwrite=true)"))
        if problems:
            raise RecipeError(problems)

    def prepare(self, *, resume: bool, overwrite: bool) -> None:
        """Create the directory, refusing to mix two runs in one place (see :meth:`check`).

        Raises:
            RecipeError: as :meth:`check`.
        """
        self.check(resume=resume, overwrite=overwrite)
        holds_run = (self.root / RECIPE).exists() or (self.root / CHECKPOINTS).exists()
        if holds_run and not resume:
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        if not resume:
            for name in (METRICS, LINEAGE):
                (self.root / name).unlink(missing_ok=True)
