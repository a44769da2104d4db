"""Supervised fine-tuning: next-token cross-entropy on the trained (assistant) tokens.

Loss of an optimizer step = sum over its trained tokens of -log p(token) / number of trained tokens
in the whole step (all micro-batches, all ranks): the token-level mean, independent of how the step is
split into micro-batches (transformers #34191).
"""

from __future__ import annotations

import numpy as np

from llmtune.core.ops import causal_lm_loss_sum, count_trained_tokens, per_sequence_loss_sum
from llmtune.core.stage import Stage, StageData
from llmtune.core.trainer import perplexity


class SFTStage(Stage):
    """SFT on chat/instruction/text rows; batches carry ``input_ids``, ``attention_mask``, ``labels`` (B, T)."""

    name = "sft"
    data_kind = "sft"
    eval_keys = ("loss_sum", "n_tokens")

    def build_data(self, tokenizer, base_dir: str) -> StageData:
        from llmtune.data import SFTCollator, build_sft_data

        data = build_sft_data(self.recipe.data, tokenizer, base_dir=base_dir)
        return StageData(data.train, data.eval, data.report, SFTCollator(tokenizer), data.report.sources_lineage())

    def count_items(self, batch):
        return count_trained_tokens(batch["labels"])

    def loss(self, model, batch, num_items):
        loss_sum, _ = causal_lm_loss_sum(self.logits(model, batch), batch["labels"])
        return loss_sum / num_items, {}

    def eval_stats(self, model, batch):
        loss_sum, n_tokens = per_sequence_loss_sum(self.logits(model, batch), batch["labels"])
        return {"loss_sum": loss_sum, "n_tokens": n_tokens}

    def eval_metrics(self, stats: dict[str, np.ndarray]) -> dict[str, float]:
        tokens = float(stats["n_tokens"].sum())
        loss = float(stats["loss_sum"].sum()) / max(tokens, 1.0)
        return {"loss": loss, "ppl": perplexity(loss), "tokens": tokens}
