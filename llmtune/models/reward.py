"""A finished ``llmtune rm`` run as a frozen scorer (PPO rewards, on-policy pair building).

The model is the RM run's base with its whole adapter chain merged (fp32 merge, cast once) and its score head; a
score is read at the last real token of each row (:func:`llmtune.models.heads.sequence_scores`), so left, right or
mixed padding give the same score. Texts are tokenized exactly as the RM's training pairs were (``PairTokenizer``:
the chat template's exact output, with the run's ``max_length``, ``max_prompt_length`` and ``truncation_mode``); token ids of generated replies get the template's text after the end-of-turn token appended
(:meth:`RewardModel.score_rollouts`), so both are scored at the position the RM was trained at.

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
        from llmtune.data.templates import template_eos_ids, turn_tail_ids
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
        self.turn_ends = set(template_eos_ids(self.tokenizer))
        self.tail = turn_tail_ids(self.tokenizer) if self.pairs.chat else []
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

    def score_rollouts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Score generated conversations given as token ids of the RM's tokenizer: (B, T) ids and mask (prompt
        left-padded + reply right-padded, any padding) -> (B,) fp32 scores.

        A row whose last real token ends the assistant turn (one of the template's end-of-turn ids) gets the
        template's text after it (:func:`llmtune.data.templates.turn_tail_ids`, ChatML ``"\n"``) appended first:
        the RM was trained on the template's exact output. A reply cut before its end-of-turn is scored as it is.
        """
        from llmtune.models.heads import last_token_index

        if not self.tail:
            return self.score_ids(input_ids, attention_mask)
        B, T, n = input_ids.shape[0], input_ids.shape[1], len(self.tail)
        last = last_token_index(attention_mask)  # (B,)
        ended = torch.tensor([int(input_ids[b, last[b]]) in self.turn_ends for b in range(B)], device=last.device)
        ids = torch.full((B, T + n), self.pad_id, dtype=input_ids.dtype, device=input_ids.device)
        mask = torch.zeros((B, T + n), dtype=attention_mask.dtype, device=attention_mask.device)
        ids[:, :T], mask[:, :T] = input_ids, attention_mask
        tail = torch.tensor(self.tail, dtype=input_ids.dtype, device=input_ids.device)
        for b in torch.nonzero(ended).flatten().tolist():
            end = int(last[b]) + 1
            ids[b, end:end + n], mask[b, end:end + n] = tail, 1  # only padding lies after the last real token
        return self.score_ids(ids, mask)

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
