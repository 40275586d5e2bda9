"""The supervised warm start: what the policy knows before RL, and so what RL can collapse from.

    losses = warm_start.fit(task, model, tok, warm_start.DEFAULTS["tiny"])     # models/policy.py

RL only moves probability among what the policy already samples. A policy that never writes
valid DSL gets reward 0 on every sample, every group's advantages are 0, and nothing is learned
(Lesson 1's frac_reward_zero_std at 1.0). So before RL the policy is fine-tuned on the task's
starting mix, the one report 001 started from: 57% valid DSL, 43% the `### Step 1` fallback
(tasks/workflow_task.py; tool calls that sometimes work for tasks/tool_task.py). Each example
is drawn independently, so the fallback is a habit of each sample, not of a prompt (Lesson 2's
page says what that does to report 001's mechanism).

The loss is the supervised one, token-mean next-token NLL, on the tokens the policy would write
only: the prompt and anything an environment inserts are labelled -100. A real model's step is
taken in micro-batches whose summed NLLs, each divided by the whole step's token count, add up
to the whole batch's gradient (sft_loss_sum; tests/test_warm_start.py against transformers' own
loss). The same rows give report 003's held-out loss: the NLL of the right answers
(answer_nll), which an overfitting run drives up while its training NLL falls.
"""
import random
import time
from dataclasses import dataclass

import torch

import logprobs
import rollout


def sft_batch(task, tok, warm: "WarmStart", rng: random.Random):
    """warm.batch fresh examples of the task's warm-start mix (up to warm.difficulty) as sft_rows."""
    return sft_rows(task, tok, task.warmstart_batch(rng, warm.batch, warm.difficulty))


def sft_rows(task, tok, examples: list):
    """(input_ids, attention_mask, labels), right-padded, from examples of (text, trained)
    segments. Loss only on the segments the policy would write (labels -100 on the prompt
    and on anything an environment inserts), and on an EOS after the last segment when the
    task ends its episodes with one."""
    rows, labels = [], []
    for segments in examples:
        row, label = [], []
        for i, (text, trained) in enumerate(segments):
            # The prompt exactly as rollouts show it (chat template included, if any).
            text = rollout.format_prompt(tok, text, task.SYSTEM_PROMPT) if i == 0 else text
            ids = tok(text, add_special_tokens=False)["input_ids"]
            row += ids
            label += ids if trained else [-100] * len(ids)
        if task.ENDS_WITH_EOS:
            row, label = row + [tok.eos_token_id], label + [tok.eos_token_id]
        rows.append(row)
        labels.append(label)
    ids = logprobs.pad(rows, tok.pad_token_id)                                # (n, L)
    mask = logprobs.pad([[1] * len(r) for r in rows], 0)                      # (n, L)
    return ids, mask, logprobs.pad(labels, -100)


@dataclass(frozen=True)
class WarmStart:
    """The supervised warm-up before RL (--sft-steps)."""
    steps: int = 300
    lr: float = 3e-3
    batch: int = 64                  # examples per step
    seed: int = 0                    # the examples' draws and the tiny model's initial weights
    difficulty: int = 1              # demonstrations of 1 .. this many benchmarks (--sft-difficulty)
    micro_batch: int = 0             # examples per forward/backward (the same gradient, less memory); 0 = all,
                                     # through model(labels=...)


# The defaults, for the tiny model and for a real one. The tiny model starts from random
# weights and needs many large steps. A real instruct model (SmolLM2-135M) already writes
# text: 30 steps of 8 examples at lr 1e-4 take it from 100% junk to report 001's mix
# (measured: README, Lesson 5), one example per forward so that its activations fit a
# laptop (docs/performance.md, Memory).
DEFAULTS = {"tiny": WarmStart(300, 3e-3, 64), "real": WarmStart(30, 1e-4, 8, micro_batch=1)}


def sft_loss_sum(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token NLL of the labelled tokens of right-padded rows (n, L):

        sum_{i,t: labels[i,t+1] != -100}  -log p(labels[i,t+1] | ids[i, <=t])

    The LM head runs only at the positions that predict a labelled token, in float32 and a few
    thousand of them at a time (logprobs.head_logits, token_logprobs): `model(labels=...)`
    computes float32 logits over the whole vocabulary at every position and then a copy for
    its loss, gigabytes for SmolLM2's 49,152 words on a tool episode."""
    h = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state  # (n, L, H)
    target = labels[:, 1:]                                                       # (n, L-1)
    keep = target != -100
    h, target = h[:, :-1][keep], target[keep]                                    # (M, H), (M,)
    step = logprobs.rows_per_chunk(1, model.get_output_embeddings().weight.shape[0])
    total = h.new_zeros((), dtype=logprobs.float32_or_wider(h).dtype)
    for i in range(0, len(target), step):
        logits = logprobs.head_logits(model, h[None, i:i + step])                # (1, m, V)
        total = total - logprobs.token_logprobs(logits, target[None, i:i + step]).sum()
    return total


def fit(task, model, tok, warm: WarmStart, log=None) -> list[float]:
    """Supervised fine-tuning on fresh draws from the report-shaped mix; returns losses (the
    token mean of each step's NLL, as `model(labels=...).loss`). With warm.micro_batch (a
    real model), each step's examples go through the model that many at a time, each part's
    summed NLL over the whole step's labelled tokens (sft_loss_sum), so the gradients add up
    to the whole batch's. log: where to say how far it is, at each quarter (it takes minutes),
    and what it did."""
    rng = random.Random(warm.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=warm.lr)
    device = next(model.parameters()).device
    losses = []
    model.train()
    t0 = time.time()
    for step in range(warm.steps):
        if log and step and step % max(warm.steps // 4, 1) == 0:
            log(f"warm-start: step {step}/{warm.steps}, loss {losses[-1]:.2f}, {time.time() - t0:.0f}s "
                f"(cached when done: the next run starts at once)")
        ids, mask, lab = (t.to(device) for t in sft_batch(task, tok, warm, rng))
        opt.zero_grad()
        if warm.micro_batch:
            tokens = (lab[:, 1:] != -100).sum().clamp_min(1)
            loss = 0.0
            for i in range(0, len(ids), warm.micro_batch):
                part = sft_loss_sum(model, ids[i:i + warm.micro_batch], mask[i:i + warm.micro_batch],
                                    lab[i:i + warm.micro_batch]) / tokens
                part.backward()
                loss += part.item()
        else:      # the tiny model: its logits are small; transformers' loss, as its lessons were recorded
            loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
            loss.backward()
            loss = loss.item()
        opt.step()
        losses.append(loss)
    if log:
        log(f"warm-start ({type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters): "
            f"{warm.steps} supervised steps of {warm.batch} in {time.time() - t0:.1f}s"
            + (f", loss {losses[0]:.2f} -> {losses[-1]:.2f}" if losses else ""))
    return losses


# ---- report 003's held-out loss: the right answers' NLL, on prompts RL never trains on ----

NLL_ROWS = 8          # answers per forward of answer_nll


@torch.no_grad()
def answer_nll(models, task, prompts: list) -> float:
    """- sum of log p(token) over the right answers' tokens / their number, teacher-forced at
    temperature 1 (prompts and tool output not counted: sft_rows's labels)."""
    model, total, tokens = models.model, 0.0, 0
    for i in range(0, len(prompts), NLL_ROWS):          # a few rows at a time: a real model's memory
        rows = sft_rows(task, models.tok, [task.answer(p) for p in prompts[i:i + NLL_ROWS]])
        ids, mask, labels = (t.to(model.device) for t in rows)
        total += sft_loss_sum(model, ids, mask, labels).item()
        tokens += int((labels[:, 1:] != -100).sum())
    return total / max(tokens, 1)


def overtrained(rows: list) -> bool:
    """Report 003's over-training, read off a run's metrics rows: the held-out answer NLL ends at
    least 10% above its lowest evaluation while the training prompts' NLL at the end is no higher
    than at that evaluation (the training loss holds or falls as the held-out loss rises)."""
    rows = [x for x in rows if x.get("eval_answer_nll") is not None]
    low = min(rows, key=lambda x: x["eval_answer_nll"])
    return rows[-1]["eval_answer_nll"] >= 1.1 * low["eval_answer_nll"] and \
        rows[-1]["train_answer_nll"] <= low["train_answer_nll"]
