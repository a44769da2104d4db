"""PPO rollouts on a tiny Llama: completions of left-padded batched generation cut at the stop set and padded into a
RolloutBatch, KL = 0 when the policy is the reference, reward/value read positions, adapter switching that keeps
gradients right under gradient checkpointing, and the Experience's micro-batches (rows, trimmed by layout)."""

import pytest
import torch
from peft import get_peft_model

from llmtune.config import load_recipe
from llmtune.models.adapters import adapter_scope, build_lora_config, enable_gradient_checkpointing
from llmtune.models.heads import sequence_scores
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from llmtune.data.templates import template_eos_ids as eos_token_ids
from llmtune.rl.engines.hf import cut_completions
from llmtune.rl.forward import response_token_logps, rollout_forward
from llmtune.rl.ops import masked_mean
from llmtune.rl.types import Experience, Layout, RolloutBatch, Trajectory, join
from llmtune.stages.ppo import ops
from llmtune.stages.ppo.trainer import PolicyValueModel, add_value_model

PROMPTS = ["What is 2 + 3?", "Hi", "Tell me a very long story about the sea and the wind, please.", "Why?"]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(pad_equals_eos=False)


def left_padded(tok, texts):
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for t in texts]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return ids, input_ids, mask


def policy_value(tok, seed=0):
    recipe = load_recipe(raw={"stage": "ppo", "reward": {"function": "llmtune.rewards:gsm8k_reward"},
                              "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
                              "train": {"max_steps": 4, "global_batch_size": 8}})
    base = make_tiny_llama(tok, seed=seed)
    policy = get_peft_model(base, build_lora_config(recipe.adapter))
    head = add_value_model(policy, recipe, None)
    return PolicyValueModel(policy, head), recipe


def split(seqs: torch.Tensor, width: int, eos, pad: int, prompts=None) -> RolloutBatch:
    """(B, P + N) generate output -> the rollout batch the trainer builds (completions cut at the stop set)."""
    completions = cut_completions(seqs[:, width:], eos, 0)
    prompts = prompts or [[1]] * len(completions)
    return RolloutBatch.from_trajectories([Trajectory.single_turn({}, p, c) for p, c in zip(prompts, completions)],
                                          pad)


def test_completions_end_at_the_first_eos_and_are_right_padded():
    seqs = torch.tensor([[0, 7, 8, 5, 2, 9, 2], [7, 7, 8, 9, 9, 9, 9], [0, 0, 8, 2, 2, 2, 2]])
    batch = split(seqs, 3, [2], 1)
    assert batch.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.completion_ids.tolist() == [[5, 2, 1, 1], [9, 9, 9, 9], [2, 1, 1, 1]]
    assert batch.ended.tolist() == [True, False, True] and torch.equal(batch.loss_mask, batch.completion_mask)


class ForceEOS:
    """Logits processor: row b emits EOS exactly at response step ``stops[b]`` (None: never), so that rows end at
    different points and finished rows get a padded tail."""

    def __init__(self, stops, prompt_width, eos):
        self.stops, self.width, self.eos = stops, prompt_width, eos

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.width
        for b, stop in enumerate(self.stops):
            if stop == step:
                scores[b] = torch.where(torch.arange(scores.shape[1]) == self.eos, 0.0, float("-inf"))
            else:
                scores[b, self.eos] = float("-inf")
        return scores


def test_batched_generation_split_equals_each_prompt_alone(tok):
    from transformers import LogitsProcessorList

    model = make_tiny_llama(tok, seed=3).eval()
    eos = eos_token_ids(tok)
    ids, input_ids, attn = left_padded(tok, PROMPTS)
    width, stops = input_ids.shape[1], [2, None, 5, 0]
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        seqs = model.generate(input_ids=input_ids, attention_mask=attn,
                              logits_processor=LogitsProcessorList([ForceEOS(stops, width, eos[0])]), **kwargs)
    batch = split(seqs, width, eos, tok.pad_token_id)
    responses, mask, ended = batch.completion_ids, batch.completion_mask, batch.ended
    assert mask.sum(1).tolist() == [3, 8, 6, 1] and ended.tolist() == [True, False, True, True]
    assert (responses[mask == 0] == tok.pad_token_id).all()
    for b, prompt in enumerate(ids):
        query = seqs[b, :width][attn[b].bool()].tolist()
        assert query == prompt  # the decoded query is exactly the prompt
        assert tok.decode(query) == tok.decode(prompt) and PROMPTS[b] in tok.decode(query)
        real = responses[b][mask[b].bool()].tolist()
        assert tok.pad_token_id not in real and eos[0] not in real[:-1]  # no pad, no EOS before the end
        with torch.no_grad():
            alone = model.generate(
                input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                logits_processor=LogitsProcessorList([ForceEOS([stops[b]], len(prompt), eos[0])]), **kwargs,
            )[0, len(prompt):].tolist()
        assert real == alone  # the response starts right after the prompt, with nothing of the prompt in it


def test_kl_is_exactly_zero_at_step_zero_and_pads_are_masked(tok):
    model, _ = policy_value(tok)
    model.eval()
    eos = eos_token_ids(tok)
    _, input_ids, attn = left_padded(tok, PROMPTS)
    with torch.no_grad(), adapter_scope(model.policy, "default"):
        seqs = model.policy.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=12, do_sample=True,
                                     eos_token_id=eos, pad_token_id=tok.pad_token_id,
                                     logits_processor=[ForceEOS([3, None, 1, 6], input_ids.shape[1], eos[0])])
    batch = split(seqs, input_ids.shape[1], eos, tok.pad_token_id)
    responses, mask = batch.completion_ids, batch.completion_mask
    assert (mask == 0).any()  # some rows have a padded tail
    inputs = join(input_ids, attn, responses, mask)
    with torch.no_grad():
        logits = model.policy_logits(**inputs, response_width=responses.shape[1])
        values = model.values(**inputs, response_width=responses.shape[1])
        ref_logits = model.reference_logits(**inputs, response_width=responses.shape[1])
    logps = response_token_logps(logits, responses, temperature=0.7) * mask
    ref = response_token_logps(ref_logits, responses, temperature=0.7) * mask
    rewards, kl = ops.per_token_rewards(torch.ones(len(PROMPTS)), logps, ref, mask.float(), kl_coef=0.1)
    assert torch.equal(kl, torch.zeros_like(kl))  # exactly, on every real token
    assert (rewards[mask == 0] == 0).all() and values.shape == responses.shape
    assert torch.equal(rewards.sum(1), torch.ones(len(PROMPTS)))  # only the score, at the last real token
    # logits of the joined input reproduce generation's own scores (left padding, positions from the mask)
    with torch.no_grad(), adapter_scope(model.policy, "default"):
        out = model.policy.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=3, do_sample=False,
                                    output_scores=True, return_dict_in_generate=True, eos_token_id=eos,
                                    pad_token_id=tok.pad_token_id)
    b3 = split(out.sequences, input_ids.shape[1], eos, tok.pad_token_id)
    resp3, mask3 = b3.completion_ids, b3.completion_mask
    with torch.no_grad():
        logits3 = model.policy_logits(**join(input_ids, attn, resp3, mask3), response_width=resp3.shape[1])
    assert torch.allclose(logits3[:, 0], out.scores[0], atol=1e-4)


def test_reward_read_at_last_real_token_for_left_and_right_padding(tok):
    from transformers import LlamaForSequenceClassification

    base = make_tiny_llama(tok, seed=1)
    rm = LlamaForSequenceClassification(base.config.__class__(**{**base.config.to_dict(), "num_labels": 1})).eval()
    seqs = [[5, 9, 11, 40, 41], [7, 8], [12, 13, 14]]
    alone = torch.cat([sequence_scores(rm, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in seqs])
    # PPO layout: prompt left-padded, response right-padded in the same row
    query = torch.tensor([[0, 5, 9], [0, 0, 7], [0, 12, 13]])
    qmask = torch.tensor([[0, 1, 1], [0, 0, 1], [0, 1, 1]])
    resp = torch.tensor([[11, 40, 41], [8, 1, 1], [14, 1, 1]])
    rmask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0]])
    both = sequence_scores(rm, torch.cat([query, resp], 1), torch.cat([qmask, rmask], 1))
    right = torch.tensor([s + [1] * (5 - len(s)) for s in seqs])
    rmask_only = torch.tensor([[1] * len(s) + [0] * (5 - len(s)) for s in seqs])
    right_scores = sequence_scores(rm, right, rmask_only)
    assert torch.allclose(both, alone, atol=1e-5) and torch.allclose(right_scores, alone, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1])  # the scores differ, so equality above means something


def _grads(model, inputs, width):
    model.zero_grad()
    logits = model.policy_logits(**inputs, response_width=width)
    values = model.values(**inputs, response_width=width)
    (logits.float().pow(2).mean() + values.pow(2).mean()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_both_adapters_trainable_and_checkpointing_recomputes_with_the_right_adapter(tok):
    model, _ = policy_value(tok)
    for name, p in model.named_parameters():  # non-zero B everywhere so both adapters change the activations
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    torch.nn.init.normal_(model.value_head.weight, std=0.5)
    _, input_ids, attn = left_padded(tok, PROMPTS[:2])
    resp = torch.randint(10, 300, (2, 5))
    inputs = join(input_ids, attn, resp, torch.ones_like(resp))
    model.train()
    plain = _grads(model, inputs, 5)
    assert any(".value." in n for n in plain) and any(".default." in n for n in plain)
    assert "value_head.weight" in plain
    base = model.policy.get_base_model()
    enable_gradient_checkpointing(base)
    checkpointed = _grads(model, inputs, 5)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6, rtol=1e-5), name
    # negative control: without the adapter-aware recompute context the value adapter's gradients are wrong
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    naive = _grads(model, inputs, 5)
    assert any(not torch.allclose(plain[n], naive[n], atol=1e-6, rtol=1e-5) for n in plain if ".value." in n)
    for name, p in model.named_parameters():  # switching adapters never froze anything
        if "lora_" in name:
            assert p.requires_grad, name


def experience(tensors: dict, prompt_width: int) -> Experience:
    exp = Experience(prompt_width)
    for key, value in tensors.items():
        layout = Layout.INPUT if key in ("input_ids", "attention_mask", "position_ids") else \
            Layout.SEQUENCE if value.dim() == 1 else Layout.TOKEN
        exp.add(key, value, layout)
    return exp


def test_micro_batches_cut_completions_to_the_longest_real_one():
    tensors = {"input_ids": torch.arange(14).reshape(2, 7), "attention_mask": torch.ones(2, 7, dtype=torch.long),
               "position_ids": torch.arange(14).reshape(2, 7), "responses": torch.arange(8).reshape(2, 4),
               "response_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])}
    for key in ("old_logps", "old_values", "advantages", "returns"):
        tensors[key] = torch.zeros(2, 4)
    tensors["row"] = torch.tensor([5, 6])
    rows = experience(tensors, prompt_width=3).micro_batch(torch.tensor([1, 0]))
    assert rows["input_ids"].tolist() == [[7, 8, 9, 10, 11], [0, 1, 2, 3, 4]]
    assert rows["responses"].shape == (2, 2) and rows["response_mask"].tolist() == [[1, 0], [1, 1]]
    assert rows["old_values"].shape == (2, 2) and rows["row"].tolist() == [6, 5]


def test_a_sequence_tensor_is_never_cut_even_when_as_wide_as_the_completions():
    """The layout is declared, not guessed from the shape: a (B,) tensor stays whole, and a (B, N) tensor
    registered as per-sequence is refused."""
    exp = experience({"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5),
                      "position_ids": torch.zeros(2, 5), "responses": torch.zeros(2, 2, dtype=torch.long),
                      "response_mask": torch.tensor([[1, 0], [1, 0]])}, prompt_width=3)
    exp.add("advantages", torch.tensor([0.5, -0.5]), Layout.SEQUENCE)
    assert exp.micro_batch(torch.tensor([0, 1]))["advantages"].tolist() == [0.5, -0.5]
    with pytest.raises(ValueError, match="does not fit layout sequence"):
        exp.add("advantages", torch.zeros(2, 2), Layout.SEQUENCE)
    with pytest.raises(ValueError, match="does not fit layout token .*width 2"):
        exp.add("old_logps", torch.zeros(2, 3), Layout.TOKEN)


def test_micro_batches_drop_the_left_padding_every_row_has():
    """Prompts of 2 and 3 real tokens left-padded to 5: the 2 columns that are padding in both rows go, the
    position ids stay those of the full rows."""
    ids = torch.arange(18).reshape(2, 9)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 0]])
    exp = experience({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
                      "responses": ids[:, 5:], "response_mask": mask[:, 5:]}, prompt_width=5)
    rows = exp.micro_batch(torch.tensor([0, 1]))
    assert rows["input_ids"].tolist() == [[2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16]]
    assert rows["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert rows["position_ids"].tolist() == [[0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5]]
    assert rows["responses"].tolist() == [[5, 6, 7], [14, 15, 16]]
    only_first = exp.micro_batch(torch.tensor([0]))  # alone, row 0 loses a third padding column
    assert only_first["input_ids"].tolist() == [[3, 4, 5, 6]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_ppo_loss_through_the_masked_head_equals_the_full_logits_loss(tok, temperature):
    """PPOStage.loss takes the policy's log-probs from the LM head at the real response tokens only; its loss,
    entropy metric and LoRA/value gradients are those of the full (b, n, V) logits path within fp32 rounding."""
    from llmtune.rl.ops import entropy_from_logits
    from llmtune.stages.ppo import PPOStage

    model, recipe = policy_value(tok, seed=3)
    recipe.rollout.temperature = temperature
    _, prompt_ids, prompt_mask = left_padded(tok, PROMPTS)
    n = 6
    gen = torch.Generator().manual_seed(7)
    mask = (torch.arange(n)[None] < torch.tensor([6, 3, 1, 4])[:, None]).long()
    responses = torch.randint(5, 60, (len(PROMPTS), n), generator=gen).masked_fill(mask == 0, tok.pad_token_id)
    batch = {**join(prompt_ids, prompt_mask, responses, mask), "responses": responses, "response_mask": mask,
             "loss_mask": mask,
             "old_logps": -torch.rand(len(PROMPTS), n, generator=gen) * 3,
             "old_values": torch.randn(len(PROMPTS), n, generator=gen),
             "advantages": torch.randn(len(PROMPTS), n, generator=gen),
             "returns": torch.randn(len(PROMPTS), n, generator=gen)}
    for p in model.parameters():  # LoRA B starts at 0: move it so that the policy differs from the reference
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    num_items = mask.sum()
    trainable = [p for p in model.parameters() if p.requires_grad]

    def no_full_logits(*args, **kwargs):
        raise AssertionError("PPOStage.loss built the (b, n, V) policy logits")

    model.policy_logits = no_full_logits  # the loss must not take the full-logits path (it did before)
    loss, metrics = PPOStage(recipe).loss(model, batch, num_items)
    del model.policy_logits
    new_grads = torch.autograd.grad(loss, trainable)

    cfg, maskf = recipe.ppo, mask.float()  # the full-logits path the stage used before
    parts = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    logits = model.policy_logits(**parts, response_width=n)
    values = model.values(**parts, response_width=n)
    logps = response_token_logps(logits, responses, temperature)
    pg = ops.policy_loss(logps, batch["old_logps"], batch["advantages"], maskf, cfg.cliprange, None)
    vf_sum, _ = ops.value_loss(values, batch["old_values"], batch["returns"], maskf, cfg.cliprange_value)
    ref_loss = (pg.loss_sum + cfg.vf_coef * vf_sum) / num_items
    ref_grads = torch.autograd.grad(ref_loss, trainable)
    entropy = masked_mean(entropy_from_logits(logits.detach().float() / temperature), maskf)

    assert abs(float(loss.detach()) - float(ref_loss.detach())) < 1e-5 and abs(float(ref_loss.detach())) > 1e-3
    assert abs(metrics["policy_entropy"] - float(entropy)) < 1e-4
    assert abs(metrics["clipfrac"] - float(pg.clipped / maskf.sum())) < 1e-6
    for new, ref in zip(new_grads, ref_grads):
        assert torch.allclose(new, ref, atol=1e-5, rtol=1e-4)
    assert any(float(g.abs().max()) > 1e-4 for g in ref_grads)


def test_ppo_rollout_forwards_use_the_masked_head_with_values(tok):
    """PPO's rollout forwards (rollout_forward with values and the reference) take log-probs and entropy from the
    LM head at the real response tokens only and the values from the value model: the full-logits numbers on real
    tokens, in chunks of the eval batch size."""
    from llmtune.rl.ops import entropy_from_logits

    model, _ = policy_value(tok, seed=5)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    _, prompt_ids, prompt_mask = left_padded(tok, PROMPTS)
    mask = (torch.arange(5)[None] < torch.tensor([5, 2, 4, 1])[:, None]).long()
    responses = torch.randint(5, 60, (4, 5), generator=torch.Generator().manual_seed(2))
    responses = responses.masked_fill(mask == 0, tok.pad_token_id)
    inputs = join(prompt_ids, prompt_mask, responses, mask)

    def no_full_logits(*args, **kwargs):
        raise AssertionError("the rollout forwards built the (b, n, V) policy logits")

    model.policy_logits = no_full_logits
    out = rollout_forward(model, inputs, responses, temperature=0.7, chunk_rows=3, reference=True, values=True)
    del model.policy_logits
    model.eval()
    with torch.no_grad():
        logits = model.policy_logits(**inputs, response_width=5)
        values = model.values(**inputs, response_width=5)
        ref = model.reference_logits(**inputs, response_width=5)
    want = {"logps": response_token_logps(logits, responses, 0.7) * mask,
            "entropy": entropy_from_logits(logits / 0.7) * mask,
            "ref_logps": response_token_logps(ref, responses, 0.7) * mask, "values": values * mask}
    assert {k for k, v in vars(out).items() if v is not None} == set(want)
    for key in want:
        torch.testing.assert_close(getattr(out, key) * mask, want[key], rtol=1e-5, atol=1e-5)
    assert float((want["logps"] - want["ref_logps"]).abs().max()) > 1e-2
