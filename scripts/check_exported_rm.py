"""Usage: python scripts/check_exported_rm.py RUN_DIR   (an `llmtune rm` run exported with `llmtune export`)

Max |score diff| between llmtune's scorer (RewardModel of the run: how PPO / pairs score) and plain transformers
on the exported RM: AutoModelForSequenceClassification forward on apply_chat_template(conv, tokenize=True), unpadded,
right-padded and left-padded batches (logits[:, 0]); also the ids cut after the last end-of-turn (end in EOS)."""
import sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from llmtune.models.reward import RewardModel
from llmtune.data.templates import template_eos_ids

run = sys.argv[1]
convs = [("What is 2 + 3?", "It is 5."), ("Say hello.", "Hello! How are you today?"),
         ("Write one sentence about the sea.", "The sea is wide and blue."),
         ("How do I make a cake?", "Mix flour, eggs, sugar and butter, then bake it for 30 minutes."),
         ("What is 12 * 7?", "12 * 7 = 84."), ("Name a color.", "Blue."),
         ("Can you help me steal a car?", "No, I can't help with that."), ("Tell me a joke.", "Why did the chicken cross the road? To get to the other side!")]
rm = RewardModel(run, batch_size=16)
model = AutoModelForSequenceClassification.from_pretrained(f"{run}/merged", dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(f"{run}/merged")
ends = set(template_eos_ids(tok))
rows = [list(tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                     tokenize=True, return_dict=True)["input_ids"]) for q, a in convs]
keep = [i for i, r in enumerate(rows) if len(r) <= rm.pairs.max_length]  # llmtune truncates longer ones
convs, rows = [convs[i] for i in keep], [rows[i] for i in keep]
ours = rm.score_texts([[{"role": "user", "content": q}] for q, _ in convs], [a for _, a in convs])
def cut(ids):
    last = max(i for i, t in enumerate(ids) if t in ends)
    return ids[:last + 1]
def batch(rs, side):
    T = max(map(len, rs)); ids = torch.full((len(rs), T), tok.pad_token_id); m = torch.zeros_like(ids)
    for b, r in enumerate(rs):
        s = slice(0, len(r)) if side == "right" else slice(T - len(r), T); ids[b, s] = torch.tensor(r); m[b, s] = 1
    return ids, m
res = {}
with torch.no_grad():
    ours_full = ours
    cuts = [cut(r) for r in rows]
    ids, m = batch(cuts, "right")
    ours_cut = rm.score_ids(ids, m)  # llmtune's reading (last real token by mask) of the ids ending in EOS
    for name, rs, ours in (("template output", rows, ours), ("ending in EOS", cuts, ours_cut)):
        un = torch.cat([model(input_ids=torch.tensor([r])).logits[:, 0] for r in rs])
        res[f"{name} unpadded"] = float((un - ours).abs().max())
        for side in ("right", "left"):
            ids, m = batch(rs, side)
            res[f"{name} {side}-padded"] = float((model(input_ids=ids, attention_mask=m).logits[:, 0] - ours).abs().max())
print("conversations", len(rows), "pad", repr(tok.pad_token), tok.pad_token_id, "eos", repr(tok.eos_token))
for k, v in res.items():
    print(f"max |score diff| {k}: {v:.3g}")
print("score range (template output)", float(ours_full.min()), float(ours_full.max()))
