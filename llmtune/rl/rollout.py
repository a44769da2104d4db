"""Rollouts (PPO, GRPO): the prompt/response split of batched sampling, model inputs, response log-probs, trimming.

Shapes: B = prompts, P = prompt width (left-padded to the longest prompt of the batch), N = generated width.
``generate`` returns (B, P + N) sequences; because every prompt is left-padded to the same width P, the response
of every row starts at column P. A response is real up to and including its first EOS; everything after it is
padding (generate keeps emitting pad/EOS for finished rows) and is masked out.
"""

from __future__ import annotations

import torch

from llmtune.models.heads import positions_from_mask


def split_generation(sequences: torch.Tensor, prompt_width: int, eos_ids: list[int], pad_id: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut generated sequences at the common prompt width and mask everything after the first EOS.

    Args:
        sequences: (B, P + N) output of ``generate`` on (B, P) left-padded prompts.
        prompt_width: P. eos_ids: ids that end a response (the chat template's end of turn and the tokenizer's
            EOS). pad_id: written over the masked tail.

    Returns:
        ``(responses, mask, ended)``: (B, N) ids with ``pad_id`` after the first EOS, (B, N) long mask (1 up to
        and including the first EOS), (B,) bool = the response contains an EOS (False: cut by max_new_tokens).
    """
    responses = sequences[:, prompt_width:]
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    eos_seen_before = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
    mask = (~eos_seen_before).long()
    return responses.masked_fill(eos_seen_before, pad_id), mask, is_eos.any(1)


def join(query_ids: torch.Tensor, query_mask: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
         ) -> dict[str, torch.Tensor]:
    """Prompt + response as one model input: ``input_ids``/``attention_mask``/``position_ids``, each (B, P + N);
    position ids count real tokens only, so left padding does not shift positions (as ``generate`` does)."""
    attention_mask = torch.cat([query_mask, response_mask], dim=1)
    return {
        "input_ids": torch.cat([query_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": positions_from_mask(attention_mask),
    }


def response_token_logps(logits: torch.Tensor, responses: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs (fp32) of the response tokens under ``logits / temperature`` (the distribution they were sampled
    from; TRL's PPO trainer does the same).

    Args:
        logits: (B, N, V), row t = the prediction of response token t. responses: (B, N).

    Returns:
        (B, N) fp32 (padding positions hold garbage: multiply by the mask).
    """
    logits = logits.float() / temperature
    picked = torch.gather(logits, -1, responses.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def decode_responses(tokenizer, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Response texts without padding and special tokens (what a reward function sees)."""
    return [tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True) for row, m in zip(responses, mask)]


INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def trim(experience: dict[str, torch.Tensor], idx: torch.Tensor, prompt_width: int) -> dict[str, torch.Tensor]:
    """Rows ``idx`` of the experience, with the response columns cut to the longest real response among them and
    the prompt columns to the longest real prompt among them (the leading columns that are left padding in every
    row go: no token attends to them, and the position ids count real tokens only, so nothing else changes).

    Args:
        experience: ``input_ids``/``attention_mask``/``position_ids`` (B, P + N), ``response_mask`` (B, N), any
            other (B, N) per-token tensor (cut like the responses) and (B,) per-sequence tensors (kept whole).
        idx: (b,) row indices. prompt_width: P.

    Returns:
        The same keys with b rows; (b, p + n) inputs and (b, n) per-token tensors, n = longest real response,
        p = longest real prompt.
    """
    rows = {k: v[idx] for k, v in experience.items()}
    n = max(int(rows["response_mask"].sum(1).max()), 1)
    used = rows["attention_mask"][:, :prompt_width].bool().any(0)  # (P,) columns some row's prompt uses
    lead = int(used.int().argmax()) if bool(used.any()) else 0
    for key, value in rows.items():
        if key in INPUT_KEYS:
            rows[key] = value[:, lead:prompt_width + n]
        elif value.dim() >= 2:
            rows[key] = value[:, :n]
    return rows
