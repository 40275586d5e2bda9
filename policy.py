"""The policy: a language model and its tokenizer, built in code or loaded from disk.

Default (no downloads, a laptop CPU): a tiny Qwen2ForCausalLM built from a config in code,
with a word-level tokenizer built in code, warm-started by a short supervised phase on
report 001's starting mix (57% valid DSL, a minority of it the best workflow, 43%
`### Step 1` fallback text). The warm-started weights are cached under .cache/warmstart/,
keyed by every setting that shapes them, so the second run starts at once.

`--model PATH` loads any local Hugging Face causal LM and its tokenizer instead (never from
a hub: local_files_only), wraps prompts in its chat template when it has one, and skips the
warm-up unless --sft-steps asks for it.
"""
import hashlib
import json
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)

import workflow_task as task

SPECIAL = ["<pad>", "<eos>", "<unk>"]
# The DSL explained once, for a real instruction-tuned model (--model); the tiny model
# learns the format from the warm-up instead.
SYSTEM_PROMPT = ("Answer with a workflow in this DSL and nothing else. Operators: "
                 "Custom, Programmer, Review, Revise, ScEnsemble, AnswerGenerate, Test, Format. "
                 "Chain with '->'; a conditional is 'A ? B : done'. "
                 "Example: Custom -> Programmer -> Review ? Revise : done")


# ---- tokenizer and model built in code ----

def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the task's vocabulary: one id per whitespace-split word."""
    vocab = {w: i for i, w in enumerate(SPECIAL + task.vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # pad and eos are different tokens on purpose: the EOS the policy samples is trained on.
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def tiny_config(tok, hidden: int, layers: int) -> Qwen2Config:
    return Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, tie_word_embeddings=True,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.eos_token_id)


# ---- supervised warm-start ----

def sft_batch(tok, batch: int, rng: random.Random):
    """(input_ids, attention_mask, labels), right-padded; loss only on completion + EOS."""
    prompts = task.make_prompts("train")
    rows, labels = [], []
    for p in rng.choices(prompts, k=batch):
        # The prompt exactly as rollouts show it (chat template included, if any).
        p_ids = tok(format_prompt(tok, p["text"]), add_special_tokens=False)["input_ids"]
        c_ids = tok(task.warmstart_completion(p["type"], rng), add_special_tokens=False)["input_ids"]
        c_ids = c_ids + [tok.eos_token_id]
        rows.append(p_ids + c_ids)
        labels.append([-100] * len(p_ids) + c_ids)
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask, lab


def warm_start(model, tok, steps: int, lr: float, batch: int, seed: int) -> list[float]:
    """Supervised fine-tuning on fresh draws from the report-shaped mix; returns losses."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        ids, mask, lab = sft_batch(tok, batch, rng)
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def cache_key(settings: dict) -> str:
    blob = json.dumps({**settings, "vocab": task.vocabulary(),
                       "mix": [task.VALID_SHARE, task.BEST_SHARE_OF_VALID, task.REPORT_TOP_PATTERNS,
                               task.FALLBACK_TEXTS, task.BEST_WORKFLOW]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tiny_policy(hidden: int, layers: int, sft_steps: int, sft_lr: float, sft_batch_size: int,
                seed: int, cache_dir: Path, log=print):
    """The tiny default policy, warm-started, from the cache when it is there."""
    tok = build_tokenizer()
    settings = dict(hidden=hidden, layers=layers, sft_steps=sft_steps, sft_lr=sft_lr,
                    sft_batch=sft_batch_size, seed=seed)
    path = Path(cache_dir) / cache_key(settings)
    if (path / "config.json").exists():
        log(f"warm-start: loaded from cache {path}")
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True), tok
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(tok, hidden, layers))
    t0 = time.time()
    losses = warm_start(model, tok, sft_steps, sft_lr, sft_batch_size, seed)
    size = f"tiny Qwen2, {sum(p.numel() for p in model.parameters()):,} parameters"
    log(f"warm-start ({size}): {sft_steps} supervised steps in {time.time() - t0:.1f}s, "
        f"loss {losses[0]:.2f} -> {losses[-1]:.2f}" if losses else f"warm-start ({size}): 0 steps")
    # Written to a temporary folder and renamed, so a crash never leaves half a cache entry.
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return model, tok


# ---- a local Hugging Face model ----

def local_policy(path: str, sft_steps: int, sft_lr: float, sft_batch_size: int, seed: int,
                 log=print):
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    tok.padding_side = "left"
    if tok.pad_token is None:
        # Pad may equal EOS here; completion masks come from the first EOS, not from pad ids.
        tok.pad_token = tok.eos_token
    if sft_steps > 0:
        losses = warm_start(model, tok, sft_steps, sft_lr, sft_batch_size, seed)
        log(f"warm-start: {sft_steps} steps, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    return model, tok


def format_prompt(tok, text: str) -> str:
    """The prompt as the model sees it: the chat template when the tokenizer has one."""
    if getattr(tok, "chat_template", None):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text
