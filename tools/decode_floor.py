"""The floor under `generate`: what sampling a GRPO batch costs at least on this machine.

    python -m tools.decode_floor --model smollm2-135m            # fp32, the bench's DSL work
    python -m tools.decode_floor --model smollm2-135m --bf16     # bf16 autocast, as train.py runs here
    python -m tools.decode_floor                                 # the tiny config (seconds)

`python -m tools.bench --model smollm2-135m` splits a step into generate, the reference's
forward, the policy's forward and backward, and AdamW. The middle two already run only the
tokens that remain (shared_prefix.py: the system prompt once, each prompt's rest once, the
completions), so they are their own floor. This measures the floor of the first, on the
bench's work (its prompts, B x K rows, its number of new tokens), each part the median of
--repeats:

    generate        what the trainer calls (rollout.generate: Hugging Face's generate, each
                    distinct prompt prefilled once)
    prefill         the distinct prompt tokens once, with no generate around them: the start
                    every prompt shares once, each prompt's rest once (shared_prefix.encode_prompts)
    decode          C decode steps of the bare model call on the N rows (KV cache, a softmax and
                    a multinomial, nothing else): generate's work without its machinery
    decode, 1 row   the same on one row: a step still reads every weight, so this part of a
                    step does not shrink with fewer rows (the memory-bandwidth floor)

C is the number of steps generate took on the same prompts (it stops when every row has
sampled EOS). prefill + decode is the floor; generate minus the floor is what Hugging Face's
machinery costs. `tests/test_lab.py` checks that the bare decode computes what a full forward
over prompt + tokens computes.
"""
import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import rollout
import shared_prefix
from tools import bench
from models import pretrained
from running import config


@torch.no_grad()
def prefill(model, ids: torch.Tensor, mask: torch.Tensor):
    """The N rows' prompts (N, P) left-padded, each distinct one encoded once (and the start
    they share once): (KV cache over N rows, its (N, P) column mask, (N, V) the logits that
    pick the first new token)."""
    rows, inverse = shared_prefix.distinct_prompts(ids, mask)                    # (U,), (N,)
    positions = (mask[rows].cumsum(-1) - 1).clamp_min(0)                           # (U, P)
    cache, cache_mask, last = shared_prefix.encode_prompts(model.base_model, ids[rows], mask[rows], positions)
    cache.reorder_cache(inverse)                                                   # U rows -> N rows
    return cache, cache_mask[inverse], model.get_output_embeddings()(last[inverse])[:, -1]


@torch.no_grad()
def decode(model, start, mask: torch.Tensor, steps: int, seed: int = 0):
    """steps tokens sampled from softmax(logits) for each row, from prefill's (cache, cache
    mask, first logits); mask: the (N, P) prompt mask (positions continue after its real
    tokens). Returns (N, steps) tokens and the (N, steps, V) logits each was drawn from. The LM
    head runs as the model's own forward runs it (under autocast when that is on), as in
    generate; a model with logit post-processing (logprobs.head_logits) would need it here too."""
    cache, cache_mask, logits = start
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    position = mask.sum(1, keepdim=True)                                           # (N, 1)
    tokens, seen = [], []
    for t in range(steps):
        seen.append(logits)
        tokens.append(torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen))   # (N, 1)
        if t == steps - 1:
            break
        cache_mask = torch.cat([cache_mask, cache_mask.new_ones(len(cache_mask), 1)], 1)
        h = model.base_model(input_ids=tokens[-1], attention_mask=cache_mask, position_ids=position + t,
                             past_key_values=cache, use_cache=True).last_hidden_state   # (N, 1, H)
        logits = model.get_output_embeddings()(h)[:, -1]                           # (N, V)
    return torch.cat(tokens, 1), torch.stack(seen, 1)


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model, tok, cfg: dict, repeats: int, bf16: bool) -> dict:
    """Seconds of each part (module docstring) on the bench's work."""
    texts = [t for t in bench.prompts(cfg, cfg["b"], 0, tok) for _ in range(cfg["k"])]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc["input_ids"], enc["attention_mask"]                            # (N, P)
    gen = rollout.plain_sampling(tok, 1.0, cfg["new"], eos_token_id=tok.eos_token_id)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    model.eval()
    with amp():
        out = rollout.generate(model, gen, True, input_ids=ids, attention_mask=mask)
        steps = out.shape[1] - ids.shape[1]
        parts = dict(
            generate=median_seconds(lambda: rollout.generate(model, gen, True, input_ids=ids, attention_mask=mask), repeats),
            prefill=median_seconds(lambda: prefill(model, ids, mask), repeats),
            decode=median_seconds(lambda: decode(model, prefill(model, ids, mask), mask, steps), repeats),
            decode_1_row=median_seconds(lambda: decode(model, prefill(model, ids[:1], mask[:1]), mask[:1], steps), repeats))
        # decode's figures hold a prefill: take it out (one row's prefill timed alone, as precise)
        one_prefill = median_seconds(lambda: prefill(model, ids[:1], mask[:1]), repeats)
    parts["decode"] -= parts["prefill"]
    parts["decode_1_row"] -= one_prefill
    return dict(rows=len(ids), prompt_tokens=ids.shape[1], steps=steps, seconds=parts,
                floor=parts["prefill"] + parts["decode"])


def main(argv=None):
    p = config.OneLineParser(prog="python -m tools.decode_floor", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a real model (train.py --model); default: the tiny config")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast, as train.py --bf16 auto picks on a CPU with fast bf16")
    p.add_argument("--repeats", type=int, default=3, help="times each part runs; the median is printed")
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.json and (Path(args.json).is_dir() or not config.writable(Path(args.json).parent)):
        p.error(f"--json: cannot write {args.json!r}")
    if args.model:
        problem = pretrained.problem(args.model)
        if problem:
            p.error(f"--model: {problem}")
    cfg = bench.REAL if args.model else bench.CONFIGS["tiny"]
    model, tok = bench.build(cfg, args.model)
    r = measure(model, tok, cfg, args.repeats, args.bf16)
    s = r["seconds"]
    print(f"{args.model or 'tiny'}, {'bf16 autocast' if args.bf16 else 'fp32'}, cpu ({torch.get_num_threads()} "
          f"threads): {r['rows']} rows, {r['prompt_tokens']}-token prompts, {r['steps']} new tokens; medians of {args.repeats}")
    print(f"  generate (as the trainer calls it)  {s['generate']:.3f} s")
    print(f"  floor: prefill {s['prefill']:.3f} s + decode {s['decode']:.3f} s ({1000 * s['decode'] / r['steps']:.1f} ms "
          f"a step) = {r['floor']:.3f} s; generate / floor {s['generate'] / r['floor']:.2f}")
    print(f"  decode on 1 row: {s['decode_1_row']:.3f} s ({1000 * s['decode_1_row'] / r['steps']:.1f} ms a step)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=args.model or "tiny", bf16=args.bf16, **r), indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("python -m tools.decode_floor: interrupted; nothing was written", file=sys.stderr)
        sys.exit(130)
