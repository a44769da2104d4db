"""KTO: Kahneman-Tversky optimization (Ethayarajh et al. 2024) on desirable / undesirable completions.

Each row is one prompt + completion with a label (unpaired thumbs-up/down data, or preference pairs split into a
desirable and an undesirable row: :mod:`llmtune.data.unpaired`). The reward ``r = beta * (logp - ref_logp)``
(reference = the policy with its adapter disabled, as DPO; log-probs summed over completion tokens in fp32 by
DPO's helper) is compared with a reference point ``z0``: the KL(policy || reference) estimated, as in the paper
and TRL's KTOTrainer, from mismatched prompt/completion pairs — prompt i with the completion of another row —
as ``mean(logp - ref_logp)`` over them, clamped at 0 and detached (no gradient flows through ``z0``).

Each row's mismatched sequence is fixed when the data is built (``kl_input_ids``/``kl_labels``,
:func:`llmtune.data.unpaired.kl_donors`; TRL builds its KL dataset once too): the completion of the next row of
its split whose prompt differs, never the row's own, so a train or eval batch of any size — one row, the last
smaller eval batch — and any number of ranks get a true mismatch. ``z0`` is estimated once per optimizer step
over ALL its rows (every micro-batch, every rank; no-grad forwards in :meth:`KTOStage.prepare_step`), so 4x1 and
1x4 give the same gradients; evaluation estimates it over the whole eval set. Rows without a trained token are
not items: they enter neither the loss, nor ``z0``, nor the metrics. Loss of an optimizer step = sum of the
weighted per-row losses / trained rows in the whole step.
"""

from __future__ import annotations


import numpy as np
import torch

from llmtune.config import Recipe, RecipeError
from llmtune.core.lm_head import sequence_logps
from llmtune.core.ops import IGNORE_INDEX
from llmtune.models.adapters import reference_scope
from llmtune.core.stage import HIGHER, LOWER, HeldOutMetric, StageData
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
    # 1 - sigmoid(t) = sigmoid(-t), without the cancellation of 1 - (a value that rounds to 1)
    losses = torch.where(desirable, desirable_weight * torch.sigmoid(-beta * (ratio - z0)),
                         undesirable_weight * torch.sigmoid(-beta * (z0 - ratio)))
    return losses, beta * ratio.detach()


def kto_kl(kl_logps: torch.Tensor, kl_ref_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0: ``mean(kl_logps - kl_ref_logps).clamp(min=0)``, detached (a scalar, fp32).

    Args:
        kl_logps, kl_ref_logps: (N,) policy / reference log-probs of N mismatched prompt + completion sequences.
    """
    return (kl_logps.float() - kl_ref_logps.float()).mean().clamp(min=0).detach()


def trained_rows(labels: torch.Tensor) -> torch.Tensor:
    """(N,) bool: rows of (N, T) ``labels`` with at least one trained target token (after the causal shift)."""
    return (labels[:, 1:] != IGNORE_INDEX).any(-1)


def kl_rows(batches: list[dict[str, torch.Tensor]]) -> list[tuple[list[int], list[int]]]:
    """The mismatched KL sequences of the rows of ``batches``, unpadded: ``[(input_ids, labels)]`` in row order.

    Args:
        batches: collated KTO batches with ``kl_input_ids``, ``kl_attention_mask``, ``kl_labels`` (B, T')
            (:class:`~llmtune.data.unpaired.UnpairedCollator`).

    Raises:
        KeyError: the batches have no KL sequences (rows not built by :func:`~llmtune.data.build_unpaired_data`).
    """
    out = []
    for batch in batches:
        for ids, mask, labels in zip(batch["kl_input_ids"], batch["kl_attention_mask"], batch["kl_labels"]):
            n = int(mask.sum())
            out.append((ids[:n].tolist(), labels[:n].tolist()))
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
    held_out_metrics = (HeldOutMetric("eval_rewards/margins", HIGHER), HeldOutMetric("eval_loss", LOWER))
    eval_keys = ("logps", "ref_logps", "kl_logps", "kl_ref_logps", "label", "pair_index", "trained")

    def __init__(self, recipe: Recipe, recipe_dir=None):
        super(DPOStage, self).__init__(recipe, recipe_dir)  # DPO's precompute_ref_logps rule does not apply: KTO has none
        if recipe.adapter.type == "none":
            raise RecipeError([("adapter.type", "KTO's reference model is the policy with its adapter disabled; full "
                                "fine-tuning (adapter.type: none) has none. Use adapter.type: lora")])

    # ---- data -------------------------------------------------------------------------------------------
    def build_data(self, tokenizer, base_dir: str) -> StageData:
        from llmtune.data.unpaired import UnpairedCollator, build_unpaired_data

        cfg = self.recipe.kto
        data = build_unpaired_data(self.recipe.data, tokenizer, base_dir=base_dir,
                                   desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
        return StageData(data.train, data.eval, data.report, UnpairedCollator(tokenizer),
                         data.report.sources_lineage())

    def count_items(self, batch):
        """Rows with at least one trained token (a row without one has no log-prob: it is no item)."""
        return trained_rows(batch["labels"]).sum()

    def render_example(self, row: dict, tokenizer) -> str:
        from llmtune.data import render_labels

        label = "desirable" if row["label"] else "undesirable"
        return f"[{label}] " + render_labels(row["input_ids"], row["labels"], tokenizer)

    def prepare_data(self, trainer, data: StageData) -> StageData:
        return data  # reference log-probs are computed per step (the KL sequences change with every step)

    # ---- log-probs (DPO's helper, on any number of rows) ----------------------------------------------------
    def sequence_logps(self, model, batch) -> torch.Tensor:
        """(N,) fp32 summed completion log-probs of an (N, T) batch of unrelated rows (not chosen/rejected halves:
        no prompt sharing), the LM head only at trained positions (:func:`llmtune.core.lm_head.sequence_logps`)."""
        return sequence_logps(model, batch, batch["labels"])

    def sequence_ref_logps(self, model, batch) -> torch.Tensor:
        """(N,) reference log-probs (adapter disabled, no grad) of an (N, T) batch."""
        inner = getattr(model, "module", model)  # DDP keeps the peft model in .module
        with torch.no_grad(), reference_scope(inner):  # trained adapter off; a frozen from_run chain stays on
            return self.sequence_logps(inner, batch)

    def kl_logratios(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) policy and (N,) reference log-probs of the KL sequences of ``batch`` (no grad)."""
        kl_batch = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"],
                    "labels": batch["kl_labels"]}
        with torch.no_grad():
            return self.sequence_logps(model, kl_batch), self.sequence_ref_logps(model, kl_batch)

    # ---- the step's reference point ----------------------------------------------------------------------
    def prepare_step(self, trainer, batches):
        """Estimate z0 over every row of the optimizer step (all micro-batches and ranks) and store it in each
        micro-batch as ``kl`` (a (1,) tensor) for :meth:`loss`."""
        rows = [row for row, trained in zip(kl_rows(batches), torch.cat([trained_rows(b["labels"]) for b in batches]))
                if trained]  # the KL sequences of the rows that count
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
        keep = trained_rows(batch["labels"])
        if "kl" in batch:
            kl = batch["kl"].reshape(())
        else:  # called outside the training loop: estimate z0 from this batch alone
            kl_logps, kl_ref_logps = self.kl_logratios(model, batch)
            kl = kto_kl(kl_logps[keep], kl_ref_logps[keep]) if keep.any() else torch.zeros(())
        losses, rewards = self._losses(logps, ref_logps, batch["label"], kl)
        metrics = self._split_metrics(logps[keep], rewards[keep], batch["label"][keep])
        return torch.where(keep, losses, 0.0).sum() / num_items, {**metrics, "kl": float(kl)}

    def eval_stats(self, model, batch):
        kl_logps, kl_ref_logps = self.kl_logratios(model, batch)
        return {"logps": self.sequence_logps(model, batch), "ref_logps": self.sequence_ref_logps(model, batch),
                "kl_logps": kl_logps, "kl_ref_logps": kl_ref_logps, "label": batch["label"].float(),
                "pair_index": batch["pair_index"].float(), "trained": trained_rows(batch["labels"]).float()}

    def eval_metrics(self, stats: dict[str, np.ndarray]) -> dict[str, float]:
        """Loss with z0 over the whole eval set; ``rewards/accuracies`` over the held-out pairs (both rows present:
        chosen reward strictly above rejected, as DPO), absent for unpaired data."""
        t = {k: torch.from_numpy(np.asarray(v)) for k, v in stats.items()}
        if "trained" in t:  # rows without a trained token are no items
            keep = t.pop("trained") > 0.5
            t = {k: v[keep] for k, v in t.items()}
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
