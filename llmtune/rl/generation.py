"""Rollout engines: how online RL samples completions. One protocol, so that vLLM (``llmtune.rl.vllm_engine``) can
replace transformers' ``generate`` without touching the stages; :func:`build_engine` picks one from ``rollout.engine``.

An engine turns (B, P) left-padded prompts into (B, P + N) sequences; everything after a row's first EOS is padding
(``rollout.split_generation`` masks it). Sampling settings come from the recipe's ``rollout:`` section
(``temperature``, ``top_p``, ``top_k``); ``greedy`` is the evaluation path.
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmtune.models.adapters import adapter_scope
from llmtune.rl.model import POLICY
from llmtune.utils import get_logger

log = get_logger("rollout")


class RolloutEngine(Protocol):
    """What the online-RL trainer calls to sample completions (interfaces of issue 22, point 2)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, P) left-padded prompts + mask -> ``(sequences, engine_logps)``: (B, P + N) long sequences
        (N <= max_new_tokens) and (B, N) fp32 log-probs of the sampled tokens under the engine's sampling
        distribution (after temperature), or None when the engine does not report them."""
        ...

    def sync(self, version: int) -> None:
        """Make the engine sample from the trainer's current policy; ``version`` = optimizer steps applied
        (``trainer.state.global_step``)."""
        ...

    def close(self) -> None:
        """Free the engine (processes, memory)."""
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

    def sync(self, version: int) -> None:
        """Nothing to do: ``generate`` runs on the training model itself."""

    def close(self) -> None:
        """Nothing to free: the training model is the trainer's."""

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 greedy: bool) -> tuple[torch.Tensor, None]:
        """``(sequences (B, P + N), None)``: transformers' scores are not the sampled tokens' log-probs under
        the trainer's forward, and the trainer's own log-probs are what the loss uses."""
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
        return sequences, None


ENGINES = ("hf", "vllm")


def vllm_recipe_problems(recipe) -> list[tuple[str, str]]:
    """What ``rollout.engine: vllm`` cannot do with this recipe (see :func:`llmtune.config.validate.rollout_problems`,
    the one list of reasons)."""
    from llmtune.config.validate import rollout_problems

    return rollout_problems(recipe.model_dump(mode="json"), engine="vllm")


def vllm_installed() -> bool:
    """Whether a python with vLLM is available to run the engine (``llmtune.rl.vllm_engine.vllm_python``)."""
    try:
        from llmtune.rl.vllm_engine import vllm_python
    except ModuleNotFoundError as exc:  # a build without the vLLM engine module; any other import error is a bug
        if exc.name != "llmtune.rl.vllm_engine":
            raise
        return False
    return vllm_python() is not None


def select_engine(recipe, cuda_available: bool | None = None, installed: bool | None = None) -> tuple[str, str]:
    """The engine ``rollout.engine`` asks for, and why.

    ``hf``/``vllm`` are taken as given; ``auto`` is vllm when CUDA is available, the recipe is one vLLM can sample
    for (LoRA on an unquantized base, see :func:`vllm_recipe_problems`) and vLLM can be used (server mode: a url
    is set; colocate: vLLM is installed here), else hf (on CPUs hf is the faster engine: issue 22's measurements).

    Args:
        recipe: the typed recipe. cuda_available / installed: overrides of ``torch.cuda.is_available()`` /
            :func:`vllm_installed` (tests).

    Returns:
        ``(engine, reason)`` with engine ``hf`` or ``vllm``.
    """
    rollout = recipe.rollout
    if rollout.engine != "auto":
        return rollout.engine, f"rollout.engine: {rollout.engine}"
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        return "hf", "rollout.engine: auto and no CUDA device (vLLM is for GPUs; on CPUs hf is faster)"
    problems = vllm_recipe_problems(recipe)
    if problems:
        return "hf", f"rollout.engine: auto and vLLM cannot sample this recipe ({problems[0][0]}: {problems[0][1]})"
    if rollout.vllm.mode == "server":
        return "vllm", f"rollout.engine: auto, CUDA and a rollout server at {rollout.vllm.url}"
    if not (vllm_installed() if installed is None else installed):
        return "hf", "rollout.engine: auto and vLLM is not installed (bash scripts/setup.sh sets it up)"
    return "vllm", "rollout.engine: auto, CUDA and vLLM installed"


def build_engine(trainer, recipe) -> RolloutEngine:
    """The rollout engine of an online-RL trainer (:func:`select_engine` picks it; the choice is logged).

    Args:
        trainer: the :class:`~llmtune.rl.trainer.OnlineRLTrainer` (``eos_ids``, ``pad_id``, model, run dir).
        recipe: the typed recipe (``rollout:`` section).

    Raises:
        RolloutEngineError: vLLM is not installed, fails to start or cannot be reached (from
            ``llmtune.rl.vllm_engine.build_vllm_engine``).
    """
    engine, reason = select_engine(recipe)
    log.info("rollout engine: %s (%s)", engine, reason)
    if engine == "vllm":
        from llmtune.rl.vllm_engine import build_vllm_engine

        return build_vllm_engine(trainer, recipe)
    r = recipe.rollout
    return HFGenerationBackend(trainer, trainer.eos_ids, trainer.pad_id, r.temperature, r.top_p, r.top_k)
