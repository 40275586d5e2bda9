"""Report 001's mechanism put to an exact test: one update, no sampling (python -m lab probe_001).

The report's reading: K=2 group norm gives exactly +1 and -1, so a valid but not best workflow
is pushed down as hard as junk, and the fallback text, never beside a different reward in its
group, gains: one K=2 update raises the chance of an off-format answer, and a 10x smaller lr
does not shrink the rise (to first order a change is proportional to lr).

From one warm start and one AdamW state (fresh, or after WARMING_STEPS real steps of the
report's setting), one GRPO update from a fixed batch of three training prompts, measured
before and after on the 32 held-out prompts, exactly: P(off), the probability that a
completion opens with the fallback's first token, and log p of the fallback text, the prompt's
best workflow and a valid non-best one. Conditions (CONDITIONS): null (every advantage 0: the
step the optimizer takes anyway), k2_group (the report's step 4: [best, best], [best, valid],
[valid, valid]: 0, +-1, 0), k2_drgrpo (0, +-0.4, 0), k8_group (3 best and 5 valid a prompt).
Two warm starts: the course's (the fallback drawn per sample) and one whose fallback is tied
to 42.8% of the prompts (tied_task). Every condition sees the same BATCHES batches (paired);
the update is the trainer's (token-mean, gradient clipped at 1, no KL); the test is the lab's
sign flip. Why each choice, and the results: docs/lessons/2-k2-in-a-real-run.md.
"""
import copy
import json
import random
import statistics
import types

import torch

import advantages
import grpo
import logprobs
import rollout
import update
from lab import stats
from models import policy
from running import config
from tasks import Sampling, workflow_task as task

BATCHES, QUICK_BATCHES = 30, 2
LRS, QUICK_LRS = (2e-6, 2e-5, 2e-4, 2e-3), (2e-4, 2e-3)
WARMING_STEPS, WARMING_LR = 5, 1e-3
REAL_LRS, REAL_WARMING_LR = (2e-6, 2e-5, 2e-4), 2e-5      # --model: its training lr, a decade either side
HELD_LR = 1e-9        # probe_001_held's warming: AdamW's moments of real steps, each weight moved about 1e-9 a step
CONDITIONS = ("null", "k2_group", "k2_drgrpo", "k8_group")
SAME_START = 1e-5   # P(off) of one warm start rebuilt on another CPU (0.380899, 0.380900): the same
MEASURES = ("p_off", "lp_fallback", "lp_best", "lp_valid")


def tied_task():
    """workflow_task whose warm start answers 42.8% of the training prompts always with the
    fallback (the prompts chosen by a seeded draw) and the others from the valid mix."""
    train = [p["text"] for p in task.make_prompts("train")]
    fallback = set(random.Random(1).sample(train, round((1 - task.VALID_SHARE) * len(train))))

    def batch(rng, n, difficulty=1):
        chosen = rng.choices(task.make_prompts("train"), k=n)
        return [[(p["text"], False), (rng.choice(task.FALLBACK_TEXTS) if p["text"] in fallback else
                                      task.valid_completion(p["type"], rng), True)] for p in chosen]
    own = {k: getattr(task, k) for k in dir(task) if not k.startswith("__")}
    own.update(warmstart_batch=batch, answered_validly=lambda p: p["text"] not in fallback,
               fingerprint=lambda difficulty=1: {**task.fingerprint(), "fallback": "tied"})
    return types.SimpleNamespace(**own)


# ---- the measurement: exact, on the held-out prompts ----

def fixed_rows(tok, prompts: list, completions: list) -> rollout.Rollout:
    """A Rollout of given completions (each with its EOS) to the given prompt texts; a prompt
    repeated over rows is encoded once in every forward (shared_prefix.py), as the trainer does."""
    p_ids, p_mask = logprobs.left_pad([tok(rollout.format_prompt(tok, p, task.SYSTEM_PROMPT), add_special_tokens=False)
                                       ["input_ids"] for p in prompts], tok.pad_token_id, None)
    c_ids = logprobs.pad([tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions],
                         tok.pad_token_id)
    return rollout.Rollout(p_ids, p_mask, c_ids, rollout.completion_mask(c_ids, tok.eos_token_id), None, None,
                           completions, share_prefix=True)


def held_out(tok) -> rollout.Rollout:
    """Each held-out prompt with three completions, in this order: the fallback text, the
    prompt's best workflow, and the commonest valid workflow that is not best."""
    prompts = task.make_prompts("eval")
    valid = [max((q for q in task.REPORT_TOP_PATTERNS if q != p["best"]), key=task.REPORT_TOP_PATTERNS.get)
             for p in prompts]
    return fixed_rows(tok, [p["text"] for p in prompts for _ in range(3)],
                      [c for p, v in zip(prompts, valid) for c in (task.FALLBACK_TEXTS[0], p["best"], v)])


@torch.no_grad()
def measure(model, held: rollout.Rollout) -> dict:
    """The mean over held-out prompts of P(off), the probability of the fallback's first token
    after the prompt, and of log p(fallback / best / valid), exactly, from one forward."""
    model.eval()
    logp = logprobs.completion_logprobs(model, held.tokens())[0]               # (3n, C)
    whole = (logp * held.completion_mask).sum(1).view(-1, 3)                    # (n, 3)
    return {"p_off": logp[0::3, 0].exp().mean().item(),
            **{f"lp_{name}": whole[:, i].mean().item() for i, name in enumerate(("fallback", "best", "valid"))}}


# ---- one update from a fixed batch ----

def probe_batch(model, tok, condition: str, rng: random.Random, pool: list) -> tuple:
    """(Rollout with its advantages, k) for three prompts of pool drawn by rng."""
    prompts = rng.sample(pool, 3)
    if condition == "k8_group":
        groups = [[p["best"]] * 3 + [task.other_valid(p["type"], rng) for _ in range(5)] for p in prompts]
    else:                               # the report's step 4: [best, best], [best, valid], [valid, valid]
        groups = [[prompts[0]["best"]] * 2, [prompts[1]["best"], task.other_valid(prompts[1]["type"], rng)],
                  [task.other_valid(prompts[2]["type"], rng) for _ in range(2)]]
    k = len(groups[0])
    batch = fixed_rows(tok, [p["text"] for p in prompts for _ in range(k)], [c for g in groups for c in g])
    with torch.no_grad():
        batch.old_logp = logprobs.completion_logprobs(model, batch.tokens())[0]
    r = torch.tensor([1.0 if c == p["best"] else 0.2 for p, g in zip(prompts, groups) for c in g])
    norm = "drgrpo" if condition == "k2_drgrpo" else "group"
    batch.advantages = torch.zeros_like(r) if condition == "null" else advantages.compute(r, k, norm)
    return batch, k


def updated(model, opt_state, batch, k: int, lr: float):
    """A copy of model after one GRPO update on batch at lr, from opt_state (None: fresh AdamW)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if opt_state is not None:               # its own copy: load_state_dict keeps the dict's tensors, and a
        opt.load_state_dict(copy.deepcopy(opt_state))   # step moves them in place (the next update would start there)
        opt.param_groups[0]["lr"] = lr
    n = len(batch.texts)
    update.update(logprobs.Scorer(model), opt, batch, grpo.HyperParams(k=k, mini_batch=n, micro_batch=n), grpo.loss)
    return model


def warmed(model, tok, lr: float = WARMING_LR, seed: int = 0) -> tuple:
    """(weights, AdamW state) after WARMING_STEPS real steps of the report's setting, at lr, drawn from seed."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    hp = grpo.HyperParams(k=2, norm="group", mini_batch=6, micro_batch=6)
    torch.manual_seed(seed)
    for step in range(WARMING_STEPS):
        prompts = random.Random(seed + step).sample(task.make_prompts("train"), 3)
        batch, _ = task.sample(rollout.Models(model, tok), prompts, 2, Sampling())
        grpo.prepare(batch, hp)
        update.update(logprobs.Scorer(model), opt, batch, hp, grpo.loss)
    return model, copy.deepcopy(opt.state_dict())


def probe(model, tok, plan: dict, pool: list, cells) -> dict:
    """{(optimizer state, lr, condition): {measure: [after - before, one per batch]}, and
    (optimizer state, "before"): the measures before any probe update}. plan: batches, lrs, the
    warming lr. cells (a Path): this warm start's finished cells, each written as it ends, under
    its P(off) before any update: a warm start that measures otherwise (by more than SAME_START)
    is another, and its cells are not mixed with these. A complete set, from any machine, is the
    result as it stands."""
    kept = json.loads(cells.read_text()) if cells.exists() else {}
    whole = [r for r in kept.values() if len(r) == 2 + 2 * len(plan["lrs"]) * len(CONDITIONS)]
    if whole:                                   # keys as deltas.json writes them: "warmed|2e-05|null"
        return {tuple(float(x) if x[0].isdigit() else x for x in k.split("|")): v for k, v in whole[0].items()}
    out, held, record = {}, held_out(tok), None
    seed = plan.get("seed", 0)                  # the second block's: 1000
    for state, (start, opt_state) in (("fresh", (model, None)), ("warmed", warmed(model, tok, plan["warming_lr"], seed))):
        out[(state, "before")] = before = measure(start, held)
        if record is None:                          # keyed by the fresh start's P(off)
            same = [k for k in kept if k[0].isdigit() and abs(float(k) - before["p_off"]) <= SAME_START]
            record = kept.setdefault(same[0] if same else f"{before['p_off']:.6f}", {})
        record[f"{state}|before"] = before
        for lr in plan["lrs"]:
            for condition in CONDITIONS:
                key = f"{state}|{lr}|{condition}"
                if key not in record:               # the same batches in every condition (rng from the seed)
                    rng, record[key] = random.Random(seed), {m: [] for m in MEASURES}
                    for _ in range(plan["batches"]):
                        batch, k = probe_batch(start, tok, condition, rng, pool)
                        after = measure(updated(start, opt_state, batch, k, lr), held)
                        for m in MEASURES:
                            record[key][m].append(after[m] - before[m])
                    (tmp := cells.with_suffix(".tmp")).write_text(json.dumps(kept))
                    tmp.replace(cells)              # whole or absent
                out[(state, lr, condition)] = record[key]
    return out


def rises(deltas: dict, state: str, lr: float) -> tuple[float, float]:
    """(mean d, one-sided p) of d = dP(off) under k2_group minus under null, paired by batch."""
    d = [a - b for a, b in zip(deltas[(state, lr, "k2_group")]["p_off"], deltas[(state, lr, "null")]["p_off"])]
    return statistics.fmean(d), stats.sign_flip(d)


def jumps(tests: dict, start: str, lr: float, lrs) -> bool:
    """k2_group raises P(off) at lr and at lr / 10 (both on the warmed optimizer), by more than
    a third as much there. tests: {(warm start, optimizer state, lr): rises(...)}."""
    small = min(lrs, key=lambda x: abs(x - lr / 10))
    if abs(small - lr / 10) > lr / 100:
        return False
    (d, p), (d_small, p_small) = tests[(start, "warmed", lr)], tests[(start, "warmed", small)]
    return p < stats.ALPHA and d > 0 and p_small < stats.ALPHA and d_small > d / 3


def probe_001_held(lab) -> dict:
    """probe_001 where report 001 starts, the fallback at its share: AdamW warmed at HELD_LR (per-sample start)."""
    # rule (written before its first run): probe_001's, on this optimizer (SmolLM2's warming took P(off) 0.381 -> 0.004)
    return probe_001(lab, held_lr=HELD_LR)


def probe_001(lab, held_lr: float = 0.0) -> dict:
    """Report 001's mechanism, exactly: one update from fixed batches (the module's docstring)."""
    # rule: for each warm start, optimizer state and lr, d = dP(off) after the k2_group update
    # minus dP(off) after the null one, paired over the batches. The k2_group update raises P(off)
    # there if the one-sided sign-flip p < 0.05 and mean d > 0. It jumps if it also raises at
    # lr / 10, by more than a third of its rise at lr (first order gives a tenth). Verdict, read
    # on the warmed optimizer (the report's runs had stepped before): reproduced if it jumps at
    # some lr in either warm start; partly if it raises P(off) at some lr but jumps nowhere (the
    # push toward the fallback is there, a rise that a 10x smaller lr does not shrink is not);
    # not reproduced if it raises P(off) at no lr.
    from lab import figures
    batches, lrs = (QUICK_BATCHES, QUICK_LRS) if lab.quick else (BATCHES, REAL_LRS if lab.model else LRS)
    plan = dict(batches=batches, lrs=lrs, warming_lr=held_lr or (REAL_WARMING_LR if lab.model else WARMING_LR),
                seed=getattr(lab, "offset", 0))      # 0, or the second block's 1000
    starts = {"per-sample fallback": task, **({} if lab.quick or held_lr else {"prompt-tied fallback": tied_task()})}
    name_ = "probe_001_held" if held_lr else "probe_001"
    results, rows, tests, out = {}, [], {}, lab.dir(name_)
    for name, t in starts.items():
        cells = out / f"cells-{name.split()[0]}.json"           # per warm start; deltas.json has them all
        if (done := out / "deltas.json").exists() and not cells.exists():   # a finished probe's record stands as
            cells.write_text(json.dumps({"done": json.loads(done.read_text()).get(name, {})}))   # its cells: no update
        model, tok = policy.load(config.Config(model=lab.model, cache_dir=str(policy.CACHE), sft_difficulty=1), t,
                                 "cpu", lambda s: print(f"  probe_001: {s}", flush=True))    # the tiny model or --model's
        print(f"  probe_001: {name}: {len(CONDITIONS)} conditions x {len(lrs)} lrs x 2 AdamW states x {batches} batches", flush=True)
        # the batches' prompts: those the warm start answers with workflows (the report's step 4 has no fallback)
        pool = [p for p in task.make_prompts("train") if getattr(t, "answered_validly", lambda p: True)(p)]
        results[name] = deltas = probe(model, tok, plan, pool, cells)
        tests.update({(name, state, lr): rises(deltas, state, lr) for state in ("fresh", "warmed") for lr in lrs})
        for state in ("fresh", "warmed"):
            rows.append(f"| {name} | {state} | before | | P(off) {deltas[(state, 'before')]['p_off']:.4f} | " +
                        " | ".join(f"{deltas[(state, 'before')][m]:.3f}" for m in MEASURES[1:]) + " | |")
        for key, d in deltas.items():
            if key[1] == "before":
                continue
            (state, lr, condition), (lo, hi) = key, stats.bootstrap(d["p_off"], [0.0])
            vs_null = tests[(name, state, lr)] if condition == "k2_group" else None
            rows.append(f"| {name} | {state} | {lr:g} | {condition} | {statistics.fmean(d['p_off']):+.5f} "
                        f"[{lo:+.5f}, {hi:+.5f}] | " + " | ".join(f"{statistics.fmean(d[m]):+.4f}" for m in MEASURES[1:])
                        + (f" | {vs_null[0]:+.5f} (p {stats.p_value(vs_null[1])})" if vs_null else " | ") + " |")
    (out / "table.md").write_text(
        f"# {name_} ({lab.model or 'the tiny model'}): one update, {batches} paired batches, exact measures on "
        f"the {len(task.make_prompts('eval'))} held-out prompts (lab/probe001.py)\n\nDeltas are after - before the "
        "update; P(off) is the chance that a completion opens with the fallback's first token; [95% bootstrap interval].\n\n"
        "| warm start | optimizer | lr | condition | dP(off) | dlog p fallback | dlog p best | dlog p valid | "
        "k2_group - null (p) |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    figures.plot_probe(results, lrs, CONDITIONS, out / "probe.png", lab.model or "tiny Qwen2")
    (out / "deltas.json").write_text(json.dumps(           # every number above, recomputable from these
        {n: {"|".join(map(str, k)): v for k, v in r.items()} for n, r in results.items()}, indent=0))
    for cells in out.glob("cells-*.json"):                  # deltas.json holds them all now
        cells.unlink()
    raised = {n: [lr for lr in lrs if tests[(n, "warmed", lr)][1] < stats.ALPHA and tests[(n, "warmed", lr)][0] > 0]
              for n in results}
    jumped = {n: [lr for lr in lrs if jumps(tests, n, lr, lrs)] for n in results}
    said = "; ".join(
        f"{n}, warmed AdamW (P(off) before {r[('warmed', 'before')]['p_off']:.3f}): k2_group - null dP(off) "
        + ", ".join(f"{tests[(n, 'warmed', lr)][0]:+.1e} at lr {lr:g} (p {stats.p_value(tests[(n, 'warmed', lr)][1])})"
                    for lr in lrs)
        + f"; fresh AdamW at lr {lrs[-1]:g}: {tests[(n, 'fresh', lrs[-1])][0]:+.1e}" for n, r in results.items())
    verdict = ("reproduced" if any(jumped.values()) else
               "partly: one K=2 update raises P(off-format) on held-out prompts, but a 10x smaller lr shrinks "
               "the rise as first order says" if any(raised.values()) else "not reproduced")
    return dict(report="001", figure=f"{name_}/probe.png",
                claim="one K=2 group-norm update on a batch of best and valid workflows pushes the policy onto "
                      "off-format text, and a 10x smaller lr does not prevent it",
                measured=f"{batches} paired batches, exact: {said}", verdict=verdict)
