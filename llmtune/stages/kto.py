"""KTO: Kahneman-Tversky optimization (Ethayarajh et al. 2024) on desirable / undesirable completions.

Each row is one prompt + completion with a label (unpaired thumbs-up/down data, or preference pairs split into a
desirable and an undesirable row: :mod:`llmtune.data.unpaired`). The reward ``r = beta * (logp - ref_logp)``
(reference = the policy with its adapter disabled, as DPO; log-probs summed over completion tokens in fp32 by
DPO's helper) is compared with a reference point ``z0``: the KL(policy || reference) estimated, as in the paper
and TRL's KTOTrainer, from mismatched prompt/completion pairs — prompt i with the completion of another row —
as ``mean(logp - ref_logp)`` over them, clamped at 0 and detached (no gradient flows through ``z0``).

``z0`` is estimated once per optimizer step over ALL its rows (every micro-batch, every rank; no-grad forwards in
:meth:`KTOStage.prepare_step`), so 4x1 and 1x4 give the same gradients, and a micro-batch of one row still gets
a mismatched completion. Row i is paired with the completion of the next row of the step (cyclically) whose
prompt differs (TRL rotates completions by one within a micro-batch). Evaluation estimates ``z0`` over the whole
eval set (rotation within each eval batch). Loss of an optimizer step = sum of the weighted per-row losses /
rows in the whole step.
"""

from __future__ import annotations

import numpy as np
import torch

from llmtune.config import Recipe, RecipeError
from llmtune.core.ops import IGNORE_INDEX
from llmtune.core.stage import StageData
from llmtune.stages.dpo import DPOStage


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KTO losses (Ethayarajh et al. 2024, Eq. 7-8; no reduction).

    With ``r = logps - ref_logps`` and ``z0 = kl`` (detached):
    desirable rows ``desirable_weight * (1 - sigmoid(beta * (r - z0)))``, undesirable rows
    ``undesirable_weight * (1 - sigmoid(beta * (z0 - r)))``.

    Args:
        logps, ref_logps: (B,) policy and reference log-probs summed over completion tokens.
        desirable: (B,) bool or 0/1: label true = desirable.
        kl: scalar reference point z0 >= 0 (see :func:`kto_kl`); never differentiated.
        beta: > 0. desirable_weight, undesirable_weight: lambda_D, lambda_U > 0.

    Returns:
        ``(losses, rewards)``: (B,) fp32 each; ``rewards = beta * (logps - ref_logps)``, detached.
    """
    ratio = logps.float() - ref_logps.float()
    z0 = torch.as_tensor(kl, dtype=torch.float32, device=ratio.device).detach()
    desirable = desirable.bool()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio))))
    return losses, beta * ratio.detach()


def kto_kl(kl_logps: torch.Tensor, kl_ref_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0: ``mean(kl_logps - kl_ref_logps).clamp(min=0)``, detached (a scalar, fp32).

    Args:
        kl_logps, kl_ref_logps: (N,) policy / reference log-probs of N mismatched prompt + completion sequences.
    """
    return (kl_logps.float() - kl_ref_logps.float()).mean().clamp(min=0).detach()


def mismatched_rows(batches: list[dict[str, torch.Tensor]], max_length: int) -> list[tuple[list[int], list[int]]]:
    """KL sequences of the rows of ``batches``: prompt i + the completion of the next row (cyclically) whose prompt
    differs (the next row if every prompt is the same), cut to ``max_length`` tokens.

    Args:
        batches: collated KTO batches (``input_ids``, ``attention_mask`` (B, T), ``prompt_length`` (B,)).
        max_length: longest sequence (the recipe's ``data.max_length``).

    Returns:
        ``[(input_ids, labels)]``, one per row in order; labels are -100 on the prompt.
    """
    prompts, completions = [], []
    for batch in batches:
        for ids, mask, p in zip(batch["input_ids"], batch["attention_mask"], batch["prompt_length"]):
            ids = ids[: int(mask.sum())].tolist()
            prompts.append(ids[: int(p)])
            completions.append(ids[int(p):])
    n, out = len(prompts), []
    for i, prompt in enumerate(prompts):
        j = next((k % n for k in range(i + 1, i + n) if prompts[k % n] != prompt), (i + 1) % n)
        completion = completions[j][: max(max_length - len(prompt), 1)]
        out.append((prompt + completion, [IGNORE_INDEX] * len(prompt) + completion))
    return out


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad ``[(input_ids, labels)]`` into ``input_ids``/``attention_mask``/``labels`` (N, T) long tensors."""
    T = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, (ids, lab) in enumerate(rows):
        input_ids[b, : len(ids)], labels[b, : len(ids)], mask[b, : len(ids)] = torch.tensor(ids), torch.tensor(lab), 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


class KTOStage(DPOStage):
    """KTO on labelled completions; batches are (B, T) rows with ``label`` (B,) and ``prompt_length`` (B,)."""

    name = "kto"
    data_kind = "unpaired"
    item_unit = "completions"
    key_metric = "eval_rewards/margins"
    eval_keys = ("logps", "ref_logps", "kl_logps", "kl_ref_logps", "label", "pair_index")

    def __init__(self, recipe: Recipe):
        super(DPOStage, self).__init__(recipe)  # DPO's precompute_ref_logps rule does not apply: KTO has none
        if recipe.adapter.type == "none":
            raise RecipeError([("adapter.type", "KTO's reference model is the policy with its adapter disabled; full "
                                "fine-tuning (adapter.type: none) has none. Use adapter.type: lora")])

    def preflight(self, base_dir: str) -> list[tuple[str, str]]:
        if self.recipe.train.global_batch_size < 2:
            return [("train.global_batch_size", "KTO estimates its KL reference point from mismatched prompt/"
                     "completion pairs of each optimizer step, which needs >= 2 rows per step; set it to 2 or more")]
        return []

    # ---- data -------------------------------------------------------------------------------------------
    def build_data(self, tokenizer, base_dir: str) -> StageData:
        from llmtune.data.unpaired import UnpairedCollator, build_unpaired_data

        cfg = self.recipe.kto
        data = build_unpaired_data(self.recipe.data, tokenizer, base_dir=base_dir,
                                   desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
        return StageData(data.train, data.eval, data.report, UnpairedCollator(tokenizer),
                         data.report.sources_lineage())

    def count_items(self, batch):
        return torch.tensor(batch["input_ids"].shape[0])

    def render_example(self, row: dict, tokenizer) -> str:
        from llmtune.data import render_labels

        label = "desirable" if row["label"] else "undesirable"
        return f"[{label}] " + render_labels(row["input_ids"], row["labels"], tokenizer)

    def prepare_data(self, trainer, data: StageData) -> StageData:
        return data  # reference log-probs are computed per step (the KL sequences change with every step)

    # ---- log-probs (DPO's helper, on any number of rows) ----------------------------------------------------
    def sequence_logps(self, model, batch) -> torch.Tensor:
        """(N,) fp32 summed completion log-probs of an (N, T) batch (DPO's :meth:`logps`, halves joined)."""
        return torch.cat(self.logps(model, batch))

    def sequence_ref_logps(self, model, batch) -> torch.Tensor:
        """(N,) reference log-probs (adapter disabled, no grad) of an (N, T) batch."""
        return torch.cat(self.reference_logps(model, batch))

    def kl_logratios(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) policy and (N,) reference log-probs of the KL sequences of ``batch`` (no grad)."""
        kl_batch = pad_rows(mismatched_rows([batch], self.recipe.data.max_length))
        kl_batch = {k: v.to(batch["input_ids"].device) for k, v in kl_batch.items()}
        with torch.no_grad():
            return self.sequence_logps(model, kl_batch), self.sequence_ref_logps(model, kl_batch)

    # ---- the step's reference point ----------------------------------------------------------------------
    def prepare_step(self, trainer, batches):
        """Estimate z0 over every row of the optimizer step (all micro-batches and ranks) and store it in each
        micro-batch as ``kl`` (a (1,) tensor) for :meth:`loss`."""
        rows = mismatched_rows(batches, self.recipe.data.max_length)
        micro = max(len(b["input_ids"]) for b in batches)
        model = trainer.model
        model.train()  # as the training forwards of this step (the Trainer sets it in training_step)
        total = torch.zeros(2, dtype=torch.float64, device=trainer.args.device)  # (sum of log-ratios, count)
        with torch.no_grad(), trainer.compute_loss_context_manager():
            for start in range(0, len(rows), micro):
                kl_batch = trainer._prepare_inputs(pad_rows(rows[start : start + micro]))
                diff = self.sequence_logps(model, kl_batch) - self.sequence_ref_logps(model, kl_batch)
                total += torch.stack([diff.double().sum(), torch.tensor(float(len(diff)), device=diff.device,
                                                                         dtype=torch.float64)])
        if trainer.args.world_size > 1:
            total = trainer.accelerator.reduce(total, reduction="sum")
        kl = (total[0] / total[1].clamp(min=1)).clamp(min=0).float().reshape(1).cpu()
        for batch in batches:
            batch["kl"] = kl

    # ---- loss and metrics --------------------------------------------------------------------------------
    def _losses(self, logps, ref_logps, desirable, kl):
        cfg = self.recipe.kto
        return kto_loss(logps, ref_logps, desirable, kl, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight)

    @staticmethod
    def _split_metrics(logps, rewards, desirable) -> dict[str, float]:
        """DPO's metric names over the desirable ("chosen") and undesirable ("rejected") rows present."""
        out = {}
        desirable = desirable.bool()
        for side, rows in (("chosen", desirable), ("rejected", ~desirable)):
            if rows.any():
                out[f"rewards/{side}"] = float(rewards[rows].mean())
                out[f"logps/{side}"] = float(logps.detach()[rows].float().mean())
        if "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    def loss(self, model, batch, num_items):
        ref_logps = self.sequence_ref_logps(model, batch)  # first: its activations are freed before the policy's
        logps = self.sequence_logps(model, batch)
        if "kl" in batch:
            kl = batch["kl"].reshape(())
        else:  # called outside the training loop: estimate z0 from this batch alone
            kl = kto_kl(*self.kl_logratios(model, batch))
        losses, rewards = self._losses(logps, ref_logps, batch["label"], kl)
        return losses.sum() / num_items, {**self._split_metrics(logps, rewards, batch["label"]), "kl": float(kl)}

    def eval_stats(self, model, batch):
        kl_logps, kl_ref_logps = self.kl_logratios(model, batch)
        return {"logps": self.sequence_logps(model, batch), "ref_logps": self.sequence_ref_logps(model, batch),
                "kl_logps": kl_logps, "kl_ref_logps": kl_ref_logps, "label": batch["label"].float(),
                "pair_index": batch["pair_index"].float()}

    def eval_metrics(self, stats: dict[str, np.ndarray]) -> dict[str, float]:
        """Loss with z0 over the whole eval set; ``rewards/accuracies`` over the held-out pairs (both rows present:
        chosen reward strictly above rejected, as DPO), absent for unpaired data."""
        t = {k: torch.from_numpy(np.asarray(v)) for k, v in stats.items()}
        kl = kto_kl(t["kl_logps"], t["kl_ref_logps"])
        desirable = t["label"] > 0.5
        losses, rewards = self._losses(t["logps"], t["ref_logps"], desirable, kl)
        out = {"loss": float(losses.mean()), **self._split_metrics(t["logps"], rewards, desirable), "kl": float(kl),
               "rows": float(len(losses))}
        pairs: dict[int, dict[bool, float]] = {}
        for index, is_desirable, reward in zip(t["pair_index"].tolist(), desirable.tolist(), rewards.tolist()):
            if index >= 0:
                pairs.setdefault(int(index), {})[is_desirable] = reward
        complete = [p for p in pairs.values() if len(p) == 2]
        if complete:
            out["rewards/accuracies"] = float(np.mean([p[True] > p[False] for p in complete]))
            out["pairs"] = float(len(complete))
        return out
