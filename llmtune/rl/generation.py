"""Generation backends: how online RL samples completions. One interface, so that a faster engine (vLLM on GPUs)
can replace transformers' ``generate`` without touching the stages.

A backend turns (B, P) left-padded prompts into (B, P + N) sequences; everything after a row's first EOS is padding
(``rollout.split_generation`` masks it). Sampling settings come from the stage's section (``temperature``,
``top_p``, ``top_k``); ``greedy`` is the evaluation path.
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmtune.models.adapters import adapter_scope
from llmtune.rl.model import POLICY


class GenerationBackend(Protocol):
    """What the online-RL trainer calls to sample completions."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 greedy: bool) -> torch.Tensor:
        """(B, P) left-padded prompts + mask -> (B, P + N) sequences (N <= max_new_tokens)."""
        ...


class HFGenerationBackend:
    """transformers' batched ``generate`` on the training model: KV cache, left-padded prompts, stops at the
    template's end-of-turn ids; under DeepSpeed ZeRO-3 the weights are gathered for generation by
    ``trl.models.utils.unwrap_model_for_generation``.

    Args:
        trainer: the online-RL trainer (its ``model_wrapped``, ``accelerator``, autocast context).
        eos_ids: ids that end a completion. pad_id: written after it.
        temperature, top_p, top_k: sampling settings (``top_k`` 0 = off).
    """

    def __init__(self, trainer, eos_ids: list[int], pad_id: int, temperature: float, top_p: float, top_k: int):
        self.trainer, self.eos_ids, self.pad_id = trainer, eos_ids, pad_id
        self.sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 greedy: bool) -> torch.Tensor:
        from trl.models.utils import unwrap_model_for_generation

        trainer = self.trainer
        sampling = {"do_sample": False} if greedy else self.sampling
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
            was_training = unwrapped.training
            unwrapped.eval()
            with adapter_scope(unwrapped.policy, POLICY), trainer.compute_loss_context_manager():
                try:
                    sequences = unwrapped.policy.generate(
                        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                        **sampling, eos_token_id=self.eos_ids, pad_token_id=self.pad_id, use_cache=True,
                    )
                except RuntimeError as exc:  # torch.multinomial: "probability tensor contains either inf, nan ..."
                    if "nan" not in str(exc) or "inf" not in str(exc):
                        raise
                    from llmtune.core.guard import NonFiniteError

                    raise NonFiniteError(
                        f"after optimizer step {trainer.state.global_step}: sampling completions met NaN/inf "
                        f"probabilities ({str(exc).strip()}); the policy's logits are not finite. Likely causes: the "
                        "learning rate is too high (lower train.learning_rate), fp16 overflow (use precision.bf16), "
                        "or a bad prompt row. No adapter or lineage.json was written.") from None
            unwrapped.train(was_training)
        return sequences
