"""A finished ``llmtune rm`` run as a frozen scorer (PPO rewards, on-policy pair building).

The model is the RM run's base with its whole adapter chain merged (fp32 merge, cast once) and its score head; a
score is read at the last real token of each row (:func:`llmtune.models.heads.sequence_scores`), so left, right or
mixed padding give the same score. Texts are tokenized exactly as the RM's training pairs were (``PairTokenizer``
with the run's chat template, ``max_length``, ``max_prompt_length`` and ``truncation_mode``).

Shapes: B = rows, T = tokens (padded).
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmtune.models.load import ModelLoadError


class RewardModel:
    """Load an RM run once and score (prompt, completion) pairs.

    Args:
        run_dir: a finished ``llmtune rm`` run (``lineage.json`` with ``model_head: score``).
        precision: dtype decision for the merged weights (a ``PrecisionConfig``); default: the RM run's own.
        batch_size: rows per forward.

    Raises:
        ModelLoadError: the run is not finished, is not a reward model, or its base cannot be loaded.
    """

    def __init__(self, run_dir: str | Path, precision=None, batch_size: int = 8):
        from transformers import AutoTokenizer

        from llmtune.config import load_recipe
        from llmtune.data.preference import PairTokenizer
        from llmtune.models.lineage import adapter_chain, load_model_with_chain, read_run

        self.run_dir = Path(run_dir)
        lineage, raw = read_run(self.run_dir)
        if lineage.get("model_head") != "score":
            raise ModelLoadError(f"reward.from_run: {self.run_dir} is a {lineage.get('stage')} run, not a reward "
                                 "model (model_head score); point it to an `llmtune rm` run")
        recipe = load_recipe(raw=raw)
        self.model = load_model_with_chain(recipe.model.model_copy(update={"from_run": None}),
                                           precision if precision is not None else recipe.precision,
                                           adapter_chain(self.run_dir, lineage), head="score").eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(self.run_dir / "adapter")
        self.pairs = PairTokenizer(self.tokenizer, recipe.data.max_length, recipe.data.max_prompt_length,
                                   recipe.data.truncation_mode, keep_system=recipe.data.truncation_keep_system)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.batch_size = batch_size

    def to(self, device) -> "RewardModel":
        self.model.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def score_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids of the RM's tokenizer (any padding) -> (B,) fp32 scores, in chunks of ``batch_size``."""
        from llmtune.models.heads import sequence_scores

        return torch.cat([
            sequence_scores(self.model, input_ids[i:i + self.batch_size], attention_mask[i:i + self.batch_size])
            for i in range(0, input_ids.shape[0], self.batch_size)
        ])

    def score_texts(self, prompts: list[list[dict]], completions: list[str]) -> torch.Tensor:
        """B prompt conversations (message lists) and B completion texts -> (B,) fp32 scores."""
        rows = [self.pairs({"prompt": p, "chosen": c, "rejected": c}).to_row()["chosen_input_ids"]
                for p, c in zip(prompts, completions)]
        width = max(map(len, rows))
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (B, T), right-padded
        attention_mask = torch.zeros_like(input_ids)
        for b, row in enumerate(rows):
            input_ids[b, :len(row)], attention_mask[b, :len(row)] = torch.tensor(row), 1
        return self.score_ids(input_ids.to(self.device), attention_mask.to(self.device))
