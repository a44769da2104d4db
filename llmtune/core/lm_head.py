"""The LM head and the log-probs of trained positions only, without (B, T, V) fp32 logits.

The plain path (:func:`llmtune.core.ops.causal_lm_loss_sum`, :func:`~llmtune.core.ops.token_logps`) projects
every position through the LM head and upcasts the (B, T, V) logits to fp32; then log-softmax keeps another
(B, T, V) copy for the backward. Most of that is wasted: SFT trains on the assistant tokens only (about half of
the positions of a chat batch, padding included), DPO scores the completions only (prompts are ~60 % of an HH pair).
Here the model is called with ``logits_to_keep`` = a (B, T) bool mask of the positions whose NEXT token is trained
(transformers >= 5 applies the head to ``hidden_states[mask]`` only), and :class:`TokenLogps` turns the (N, V)
logits into the (N,) target log-probs in chunks, keeping ONE (N, V) fp32 buffer (the softmax, which it turns into
the gradient in place during the backward) instead of three. The result is the same as the plain path up to fp32
rounding (tests/unit/core/test_lm_head.py).

Shapes: B = rows, T = tokens per row (padded), V = vocabulary, N = trained positions of the batch
(``(labels[:, 1:] != -100).sum()``).
"""

from __future__ import annotations

import functools
import inspect

import torch

from llmtune.core.ops import IGNORE_INDEX

CHUNK_ROWS = 256  # rows of the (chunk, V) fp32 temporaries of TokenLogps (50 MB at V = 49k, 125 MB at V = 128k)


def next_token_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions whose next token is trained, and those next tokens.

    Args:
        labels: (B, T) unshifted labels, -100 where not trained.

    Returns:
        ``(keep, targets)``: (B, T) bool, True at position t when ``labels[:, t + 1] != -100`` (the last column is
        always False), and the (N,) long targets ``labels[:, t + 1]`` at those positions in row-major order (the
        order of ``hidden_states[keep]``).
    """
    shifted = labels[:, 1:]
    trained = shifted != IGNORE_INDEX
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = trained
    return keep, shifted[trained]


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``*ForCausalLM`` inside DDP / DeepSpeed (``.module``) and peft (``get_base_model``)."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


@functools.lru_cache(maxsize=None)
def _slices_by_mask(model_class: type) -> bool:
    """Whether the class's forward applies its head through ``slice_logits_to_keep`` (which accepts a bool mask)."""
    try:
        return "slice_logits_to_keep" in inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return False


def supports_masked_head(model: torch.nn.Module) -> bool:
    """True when ``model(..., logits_to_keep=<(B, T) bool>)`` returns the (N, V) logits of the masked positions."""
    return _slices_by_mask(type(causal_lm(model)))


def masked_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
    """(N, V) logits at the ``keep`` positions, in ``hidden_states[keep]`` (row-major) order.

    Goes through ``model.forward`` (so DDP, DeepSpeed, peft and gradient checkpointing see a normal forward) with
    ``use_cache=False`` (with a cache transformers does not isolate packed rows). Models whose forward does not
    take a bool ``logits_to_keep`` get the plain full forward, then the kept rows (same values, more work).

    Args:
        model: a causal LM (plain, peft, DDP or DeepSpeed wrapped).
        batch: ``input_ids`` (B, T) and ``attention_mask`` or ``position_ids`` (B, T); other keys are ignored.
        keep: (B, T) bool.
    """
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    if supports_masked_head(model):
        logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits
        if logits.dim() == 2:
            return logits
        return logits[keep]  # pragma: no cover - a forward that ignored the mask
    return model(**inputs, use_cache=False).logits[keep]


class TokenLogps(torch.autograd.Function):
    """``log_softmax(logits)[i, targets[i]]`` for (N, V) logits, with one (N, V) fp32 buffer for the backward.

    Forward, chunk by chunk: ``logp_i = x_i[t_i] - logsumexp(x_i)``; with gradients on, the chunk of the buffer is
    turned into ``softmax(x_i)`` in place. Backward: ``d logp_i / d x_i = onehot(t_i) - softmax(x_i)``, also in place.
    fp32 logits are used as that buffer (they are not needed afterwards: nothing else may hold them; autograd's
    version counter raises if something saved them), other dtypes are upcast once into it. The graph can be
    backpropagated once (no ``retain_graph``).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK_ROWS) -> torch.Tensor:
        needs_grad = ctx.needs_input_grad[0]
        buf = logits.detach() if logits.dtype == torch.float32 else logits.detach().float()
        out = torch.empty(buf.shape[0], dtype=torch.float32, device=buf.device)
        for start in range(0, buf.shape[0], chunk):
            x, t = buf[start:start + chunk], targets[start:start + chunk]
            lse = torch.logsumexp(x, dim=-1)
            out[start:start + chunk] = x.gather(1, t.unsqueeze(1)).squeeze(1) - lse
            if needs_grad:
                x.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place
        if needs_grad:
            ctx.save_for_backward(buf, targets)
            ctx.logits_dtype, ctx.used = logits.dtype, False
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.used:
            raise RuntimeError("TokenLogps keeps its softmax in place: its graph can be backpropagated only once")
        ctx.used = True
        probs, targets = ctx.saved_tensors
        grad = probs.mul_(-grad_out.float().unsqueeze(1))  # -g * softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad.index_put_((rows, targets), grad_out.float(), accumulate=True)  # + g * onehot
        return grad.to(ctx.logits_dtype), None, None


def masked_token_logps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-probs of the trained next tokens only.

    Args:
        model: causal LM. batch: ``input_ids`` (B, T) + ``attention_mask`` or ``position_ids``.
        labels: (B, T) unshifted, -100 where not trained.
        temperature: the logits are divided by it (sampling temperature of online RL); 1 = none.

    Returns:
        ``(logps, keep)``: (N,) fp32 ``log p(labels[t + 1] | tokens <= t)`` at the kept positions (row-major) and the
        (B, T) bool ``keep`` mask of :func:`next_token_targets`.
    """
    keep, targets = next_token_targets(labels)
    logits = masked_logits(model, batch, keep)
    if temperature != 1.0:
        logits = logits / temperature
    return TokenLogps.apply(logits, targets), keep


def rows_of(keep: torch.Tensor) -> torch.Tensor:
    """(N,) row index of every True of a (B, T) mask, in row-major order."""
    return keep.nonzero(as_tuple=True)[0]


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """(B,) fp32 log-probs of each row's trained tokens, summed (0 for a row without trained tokens)."""
    logps, keep = masked_token_logps(model, batch, labels)
    return logps.new_zeros(labels.shape[0]).index_add(0, rows_of(keep), logps)


def per_token_logps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """(B, T-1) fp32 log-probs of the next tokens, 0 where ``labels[:, 1:] == -100`` (the layout of
    :func:`llmtune.core.ops.token_logps`), with the head applied at the trained positions only (online RL: the
    completion tokens of a rollout; ``temperature`` divides the logits)."""
    logps, keep = masked_token_logps(model, batch, labels, temperature)
    dense = logps.new_zeros(keep.shape)
    dense = dense.masked_scatter(keep, logps)  # differentiable: gradients flow back to logps
    return dense[:, :-1]


# ---- preference pairs: the prompt computed once for chosen and rejected ---------------------------------------------
SHARED_PROMPT_ATTENTION = ("sdpa", "eager")  # kernels that take a custom 4-D mask (flash varlen does not)


def sliding_window(config) -> int | None:
    """The sliding window (tokens) of the model's windowed attention layers, or None when every layer attends to the
    whole sequence: Gemma 3 / gpt-oss / Qwen3 mark their windowed layers in ``layer_types``, Mistral / Phi-3 /
    Mixtral window every layer when ``sliding_window`` is set."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window) if isinstance(window, int) and window > 0 else None


def shares_prompts(lm: torch.nn.Module, longest: int) -> bool:
    """Whether sequences of up to ``longest`` tokens can be packed with shared prompts on ``lm``
    (:func:`pack_shared_prompts`): its attention kernel takes a custom 4-D mask, and no sliding window is shorter
    than the sequences (a custom mask replaces the model's windowed one; within the window both are the same)."""
    window = sliding_window(lm.config)
    return getattr(lm.config, "_attn_implementation", None) in SHARED_PROMPT_ATTENTION and (
        window is None or longest <= window)


def pack_shared_prompts(groups: list[tuple[torch.Tensor, list[torch.Tensor]]], dtype: torch.dtype
                        ) -> tuple[dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """Pack each prompt with its completions into one row ``prompt + completion_1 + ... + completion_G`` in which the
    prompt is computed once: completion j has the position ids it has in its own sequence (``p, p + 1, ...``) and a
    4-D mask that lets it attend to the prompt and to itself only, never to the completions before it. Every token
    therefore sees exactly the keys, queries and positions it sees in its own sequence: the same log-probs up to
    float rounding, for (G - 1) x p fewer tokens per group. Used by DPO's pairs (G = 2, :func:`shared_prompt_rows`)
    and online RL's groups (:func:`llmtune.rl.model.shared_prompt_batch`).

    Args:
        groups: K ``(prompt (p,), [completion (n_j,), ...])`` token-id tensors, ``p >= 1``.
        dtype: ``torch.bool`` for SDPA (True = attend), else the float dtype of an additive mask (eager attention).

    Returns:
        ``{input_ids, position_ids}`` (K, S) right-padded with ``attention_mask`` (K, 1, S, S) (bool, or additive:
        0 = attend, dtype min = masked), and per group per completion the (n_j,) flat index ``k * S + position`` of
        the position whose logits predict each of its tokens (the first one: the prompt's last position).
    """
    rows, positions, layout = [], [], []
    device = groups[0][0].device
    for prompt, completions in groups:
        p = prompt.numel()
        parts, pos, spans, start = [prompt], [torch.arange(p, device=device)], [], p
        for completion in completions:
            n = completion.numel()
            parts.append(completion)
            pos.append(torch.arange(p, p + n, device=device))
            spans.append((start, n))
            start += n
        rows.append(torch.cat(parts))
        positions.append(torch.cat(pos))
        layout.append((p, spans))
    K, S = len(rows), max(len(r) for r in rows)
    ids = rows[0].new_zeros(K, S)
    pos_ids = torch.zeros(K, S, dtype=torch.long, device=device)
    allowed = torch.zeros(K, S, S, dtype=torch.bool, device=device)
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    idx = torch.arange(S, device=device)
    predictors = []
    for k, (row, pos, (p, spans)) in enumerate(zip(rows, positions, layout)):
        s = len(row)
        ids[k, :s], pos_ids[k, :s] = row, pos
        allowed[k, :s, :s] = causal[:s, :s]
        allowed[k, idx[s:], idx[s:]] = True  # padding queries see themselves (no all-masked row)
        group = []
        for start, n in spans:
            allowed[k, start:start + n, p:start] = False  # never the completions before this one
            before = torch.arange(start - 1, start + n - 1, device=device)
            if n:
                before[0] = p - 1  # the first token is predicted by the end of the prompt
            group.append(k * S + before)
        predictors.append(group)
    if dtype == torch.bool:
        mask = allowed[:, None]
    else:
        mask = torch.zeros(K, 1, S, S, dtype=dtype, device=device).masked_fill_(~allowed[:, None],
                                                                              torch.finfo(dtype).min)
    return {"input_ids": ids, "position_ids": pos_ids, "attention_mask": mask}, predictors


def kept_positions(wanted: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``keep`` (size,) bool = the flat positions in ``wanted`` (M,), and ``gather`` (M,) = the index of each wanted
    position among the kept ones in row-major order (the rows of :func:`masked_logits`' output)."""
    keep = torch.zeros(size, dtype=torch.bool, device=wanted.device)
    keep[wanted] = True
    return keep, (keep.long().cumsum(0) - 1)[wanted]


def shared_prompt_rows(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Rewrite a (2B, T) pair batch as B rows ``prompt + chosen + rejected`` in which the prompt is computed once
    (:func:`pack_shared_prompts` with G = 2): the rejected tokens never see the chosen ones, and every token has
    the keys, queries and positions of its own sequence, for ~P fewer tokens per pair.

    Args:
        batch: ``input_ids``, ``attention_mask`` and ``labels`` (2B, T), right-padded: rows 0..B-1 chosen, B..2B-1
            rejected (:class:`llmtune.core.stage.PairwiseStage`). The prompt of a pair is the identical prefix before
            the first trained token of either side.
        dtype: ``torch.bool`` for SDPA (True = attend), else the float dtype of an additive mask (eager attention).

    Returns:
        ``input_ids``/``position_ids`` (B, S), ``attention_mask`` (B, 1, S, S) bool or additive (0 = attend, dtype
        min = masked), ``keep`` (B, S) bool positions whose logits are needed, ``gather`` (N,) index of each scored
        token's logits row among the kept ones, ``targets`` (N,), ``pair`` (N,) its pair, ``rejected`` (N,) bool
        its side. ``None`` when the batch has no such shared prefix or is not right-padded (then use the plain path).
    """
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    n, device = ids.shape[0] // 2, ids.device
    lengths = mask.sum(-1)
    if not torch.equal(mask, (torch.arange(mask.shape[1], device=device) < lengths[:, None]).to(mask.dtype)):
        return None  # not right-padded
    trained = labels != IGNORE_INDEX
    first = torch.where(trained.any(-1), trained.int().argmax(-1), lengths)
    groups, group_labels = [], []
    for i in range(n):
        lc, lr = int(lengths[i]), int(lengths[n + i])
        p = int(min(first[i], first[n + i]))
        if p < 1 or not torch.equal(ids[i, :p], ids[n + i, :p]):
            return None
        groups.append((ids[i, :p], [ids[i, p:lc], ids[n + i, p:lr]]))
        group_labels.append((labels[i, p:lc], labels[n + i, p:lr]))
    packed, predictors = pack_shared_prompts(groups, dtype)
    wanted, targets, pair, rejected = [], [], [], []
    for i, ((_, completions), sides, group) in enumerate(zip(groups, group_labels, predictors)):
        for side, (completion, side_labels, before) in enumerate(zip(completions, sides, group)):
            scored = side_labels != IGNORE_INDEX
            wanted.append(before[scored])
            targets.append(completion[scored])
            pair.append(torch.full((int(scored.sum()),), i, dtype=torch.long, device=device))
            rejected.append(torch.full((int(scored.sum()),), side == 1, dtype=torch.bool, device=device))
    K, S = packed["input_ids"].shape
    keep, gather = kept_positions(torch.cat(wanted), K * S)
    return {**packed, "keep": keep.view(K, S), "gather": gather, "targets": torch.cat(targets),
            "pair": torch.cat(pair), "rejected": torch.cat(rejected)}


def pair_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor],
               share_prompt: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) chosen and (B,) rejected fp32 log-probs of a (2B, T) pair batch, summed over their trained tokens.

    With ``share_prompt`` (and an attention kernel that takes a 4-D mask, no sliding window shorter than the pairs:
    :func:`shares_prompts`) the prompt of each pair is computed once (:func:`shared_prompt_rows`); otherwise, or when the batch does not allow it, the 2B rows are run as they are.
    Either way the LM head runs only where a completion token is predicted.
    """
    if batch["input_ids"].shape[0] % 2:
        raise ValueError(f"pair_logps needs a (2B, T) batch of chosen then rejected rows; got "
                         f"{batch['input_ids'].shape[0]} rows (use sequence_logps for unpaired rows)")
    n = batch["input_ids"].shape[0] // 2
    shared, lm = None, causal_lm(model)
    attention = getattr(lm.config, "_attn_implementation", None)
    if share_prompt and shares_prompts(lm, int(batch["attention_mask"].sum(-1).max())):
        shared = shared_prompt_rows(batch, torch.bool if attention == "sdpa" else lm.dtype)
    if shared is None:
        sums = sequence_logps(model, batch, batch["labels"])
        return sums[:n], sums[n:]
    logits = masked_logits(model, shared, shared["keep"])  # (M, V): the prompt end is needed by both sides
    logps = TokenLogps.apply(logits[shared["gather"]], shared["targets"])  # (N,)
    rej = shared["rejected"]
    chosen = logps.new_zeros(n).index_add(0, shared["pair"][~rej], logps[~rej])
    rejected = logps.new_zeros(n).index_add(0, shared["pair"][rej], logps[rej])
    return chosen, rejected
