"""Supervised fine-tuning: next-token cross-entropy on the trained (assistant) tokens.

Loss of an optimizer step = sum over its trained tokens of -log p(token) / number of trained tokens
in the whole step (all micro-batches, all ranks): the token-level mean, independent of how the step is
split into micro-batches (transformers #34191).
"""

from __future__ import annotations

import numpy as np
import torch

from llmtune.core.distributed import partitioned_parameters
from llmtune.core.fused import fuse_swiglu, recompute_norm_outputs
from llmtune.core.lm_head import masked_token_logps, rows_of
from llmtune.core.ops import count_trained_tokens, perplexity
from llmtune.core.padding_free import PaddingFreeCollator, isolates_packed_rows, use_varlen_attention
from llmtune.core.stage import Stage, StageData
from llmtune.utils import get_logger

log = get_logger("stages.sft")


class SFTStage(Stage):
    """SFT on chat/instruction/text rows; batches carry ``input_ids``, ``attention_mask``, ``labels`` (B, T), or with
    ``data.padding_free`` (default) ``input_ids``, ``labels``, ``position_ids``, ``row_index`` (1, L)."""

    name = "sft"
    data_kind = "sft"
    eval_keys = ("loss_sum", "n_tokens")

    def build_data(self, tokenizer, base_dir: str) -> StageData:
        from llmtune.data import SFTCollator, build_sft_data

        data = build_sft_data(self.recipe.data, tokenizer, base_dir=base_dir)
        self._collator = PaddingFreeCollator() if self.recipe.data.padding_free else SFTCollator(tokenizer)
        return StageData(data.train, data.eval, data.report, self._collator, data.report.sources_lineage())

    def prepare_model(self, model, tokenizer):
        packed = self.recipe.data.padding_free or self.recipe.data.packing  # rows share a sequence
        varlen = packed and use_varlen_attention(model)  # SDPA: attention row by row in the (1, L) sequences
        if packed and not varlen and not partitioned_parameters(model) and not isolates_packed_rows(model):
            kernel = getattr(model.config, "_attn_implementation", None)
            if self.recipe.data.packing:
                from llmtune.config import RecipeError

                raise RecipeError([("data.packing", f"{type(model).__name__} with {kernel} attention lets packed rows "
                                    "attend to each other (its attention mask ignores their position ids): set "
                                    "data.packing: false (padding-free batches are then padded for this model)")])
            log.info("%s with %s attention does not keep packed rows apart: SFT batches are padded instead of "
                     "padding-free (same loss)", type(model).__name__, kernel)
            from llmtune.data import SFTCollator

            if isinstance(getattr(self, "_collator", None), PaddingFreeCollator):
                self._collator.padded = SFTCollator(tokenizer)
        fuse_swiglu(model)  # same gradients, one activation fewer per MLP
        recompute_norm_outputs(model)  # same gradients, the norm outputs recomputed in the backward
        return model

    def count_items(self, batch):
        return count_trained_tokens(batch["labels"])

    def loss(self, model, batch, num_items):
        # LM head at the trained positions only (llmtune.core.lm_head): same loss as the full-logits cross-entropy
        logps, _ = masked_token_logps(model, batch, batch["labels"])  # (N,) fp32
        return -logps.sum() / num_items, {}

    def eval_stats(self, model, batch):
        logps, keep = masked_token_logps(model, batch, batch["labels"])
        if "row_index" in batch:  # padding-free: the (1, L) sequence holds B rows
            rows, n = batch["row_index"][keep], int(batch["row_index"].max()) + 1
        else:
            rows, n = rows_of(keep), keep.shape[0]
        loss_sum = logps.new_zeros(n).index_add(0, rows, -logps)  # (B,)
        return {"loss_sum": loss_sum, "n_tokens": logps.new_zeros(n).index_add(0, rows, torch.ones_like(logps))}

    def eval_metrics(self, stats: dict[str, np.ndarray]) -> dict[str, float]:
        tokens = float(stats["n_tokens"].sum())
        loss = float(stats["loss_sum"].sum()) / max(tokens, 1.0)
        return {"loss": loss, "ppl": perplexity(loss), "tokens": tokens}
