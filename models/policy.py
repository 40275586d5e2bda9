"""The policy: a language model and its tokenizer, built in code or loaded from disk.

Default (no downloads, a laptop CPU): a tiny Qwen2ForCausalLM built from a config in code,
with a word-level tokenizer built in code over the task's vocabulary, warm-started by a
short supervised phase on the task's starting mix (tasks/workflow_task.py: report 001's 57% valid
DSL / 43% `### Step 1` fallback text; tasks/tool_task.py: tool calls that sometimes work). The
warm-started weights are cached under the repository's .cache/warmstart/ (CACHE, wherever the
command runs from), keyed by every setting that shapes them, so the second run starts at once.

`--model` loads a real pretrained model instead (a folder that pretrained.py resolved: the
named smollm2-135m, a local folder, a hub id), wraps prompts in its chat template, and
warm-starts it on the same mix with its own defaults (warm_start.DEFAULTS), cached the same way.
bf16 autocast is used where it is measured faster (autocast_choice).

`task` below is a task module (workflow_task or tool_task): its vocabulary, its warm-start
examples, its system prompt.
"""
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, models, pre_tokenizers
# transformers' model classes are imported where a model is built: importing them costs seconds
# (more on a busy machine), which `train.py --help` and a mistyped flag need not pay
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

import logprobs
import warm_start
from models import pretrained
from models.pretrained import ModelError, set_aside

SPECIAL = ["<pad>", "<eos>", "<unk>"]
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "warmstart"     # the default --cache-dir


# ---- tokenizer and model built in code ----

def build_tokenizer(words: list) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over a task's vocabulary: one id per whitespace-split word."""
    vocab = {w: i for i, w in enumerate(SPECIAL + list(words))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # pad and eos are different tokens on purpose: the EOS the policy samples is trained on.
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    return tok


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(folder: Path):
    """A saved tokenizer, as it was saved. AutoTokenizer (transformers 5) gives a folder whose
    config.json says qwen2 the Qwen2 tokenizer class, whatever its tokenizer_config.json says,
    and that class reads the tiny model's word-level tokenizer.json as byte-pair pieces: a
    checkpoint of the tiny model would encode "### Step 1 : Analyze" as 3 wrong tokens and
    decode them as "1:a", and the report's fallback would be counted as junk. A folder whose
    tokenizer_config.json names the generic class (what save_pretrained writes for a tokenizer
    built in code) is loaded as that class, from its tokenizer.json; any other by AutoTokenizer."""
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def tiny_config(tok, hidden: int, layers: int, max_positions: int = 128, **shape) -> Qwen2Config:
    """A Qwen2 config over tok's vocabulary: 4 heads (2 for keys and values), a 4 x hidden MLP
    and tied embeddings, unless shape says otherwise (tools/bench.py's larger shapes, the tests')."""
    shape = dict(dict(intermediate_size=4 * hidden, num_attention_heads=4, num_key_value_heads=2), **shape)
    return Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                       max_position_embeddings=max_positions, tie_word_embeddings=True,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.eos_token_id, **shape)


def cache_key(settings: dict, task, difficulty: int = 1) -> str:
    blob = json.dumps({**settings, **task.fingerprint(difficulty)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached(path: Path, build, log=print):
    """(model, tokenizer) from the cache folder path, or build() them and cache them there.

    Written to a temporary folder of this process's own and renamed, so a crash never leaves
    half a cache entry, and two runs warming up the same entry at once do not collide: the
    first rename wins, the other run drops its copy and loads the winner's. An entry that does
    not load (a missing config.json, truncated weights: a disk, not this code, cut it) is moved
    aside as NAME.damaged-PID, said in one line, and built again."""
    if path.exists():
        try:
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
            log(f"warm-start: loaded from cache {path}")
            return model, load_tokenizer(path)
        except (OSError, ValueError, SafetensorError) as e:
            aside = set_aside(path)
            print(f"warm-start: the cache entry {path} did not load ({type(e).__name__}: {str(e)[:120]}); "
                  f"moved to {aside.name}, building it again", file=sys.stderr)
    model, tok = build()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    except (OSError, SafetensorError) as e:     # a full disk, a file-size limit: the run goes on uncached
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"warm-start: not cached ({type(e).__name__}: {str(e)[:120]}); this run goes on, the next one "
              f"warms up again", file=sys.stderr)
        return model, tok
    try:
        tmp.rename(path)
    except OSError:                              # "Directory not empty": another run won
        shutil.rmtree(tmp, ignore_errors=True)
        if not path.exists():
            raise
        log(f"warm-start: another run cached the same warm start first; using {path}")
        return cached(path, build, log)
    return model, tok


def tiny_policy(task, hidden: int, layers: int, warm: warm_start.WarmStart, cache_dir: Path, log=print):
    """The tiny default policy for a task, warm-started, from the cache when it is there."""
    def build():
        tok = build_tokenizer(task.vocabulary())
        torch.manual_seed(warm.seed)
        from transformers import Qwen2ForCausalLM
        model = Qwen2ForCausalLM(tiny_config(tok, hidden, layers, task.MAX_POSITIONS))
        warm_start.fit(task, model, tok, warm, log)
        return model, tok
    settings = dict(hidden=hidden, layers=layers, sft_steps=warm.steps, sft_lr=warm.lr,
                    sft_batch=warm.batch, seed=warm.seed)
    model, _ = cached(Path(cache_dir) / cache_key(settings, task, warm.difficulty), build, log)
    # the tokenizer built in code, not its saved copy: the same vocabulary, and no file format between
    return model, build_tokenizer(task.vocabulary())


# ---- a real (pretrained) Hugging Face model ----

def tied_keys(model) -> set:
    """The output embedding's weight when it is the input embedding's (tie_word_embeddings): a
    checkpoint need not store it."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    head = model.get_output_embeddings()
    return {name for name, p in model.named_parameters(remove_duplicate=False) if p is head.weight}


def real_policy(task, folder: Path, warm: warm_start.WarmStart, cache_dir: Path, device: str = "cpu", log=print):
    """A Hugging Face causal-LM folder (pretrained.resolve) and its tokenizer, float32 weights
    on device, checked (logprobs.check_logprobs), warm-started on the task's mix when
    warm.steps > 0 and cached under cache_dir, keyed by the model and every warm-start setting."""
    def load():            # checked here, so a model we would get wrong is refused before any warm-up
        from transformers import AutoModelForCausalLM
        try:               # a folder that passed pretrained's checks can still not be a causal LM we can load
            tok = load_tokenizer(Path(folder))
            model, info = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                               output_loading_info=True)
            if len(tok) == 0:
                raise ValueError("its tokenizer has no vocabulary")
            missing = [k for k in info["missing_keys"] if k not in tied_keys(model)]
            if missing:     # transformers fills them with random numbers: training that is no model's
                raise ValueError(f"its weights lack {len(missing)} of the model's tensors ({missing[0]}, ...)")
        except (OSError, ValueError, KeyError, RuntimeError, TypeError, AttributeError) as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise ModelError(f"--model: {str(folder)!r} does not load as a causal language model with its "
                             f"tokenizer ({type(e).__name__}: {first})") from e
        error = logprobs.check_logprobs(model)
        if not error < 1e-3:
            raise ModelError(f"--model: {str(folder)!r} ({type(model).__name__}) transforms its logits in a "
                             f"way logprobs.head_logits does not reproduce (log-probs off by {error:.3g}); "
                             f"its ratios and KLs would be wrong, so it is refused")
        return model.to(device), tok

    def build():
        model, tok = load()
        warm_start.fit(task, model, prepare_tokenizer(tok), warm, log)
        return model, tok
    if warm.steps > 0:
        identity = {"model": str(Path(folder).resolve()), "config": (Path(folder) / "config.json").read_text(),
                    "files": sorted((f.name, f.stat().st_size) for f in Path(folder).iterdir())}
        settings = dict(identity, sft_steps=warm.steps, sft_lr=warm.lr, sft_batch=warm.batch, seed=warm.seed)
        model, tok = cached(Path(cache_dir) / cache_key(settings, task, warm.difficulty), build, log)
        model = model.to(device)
    else:
        model, tok = load()
    return model, prepare_tokenizer(tok)


def prepare_tokenizer(tok):
    """Left padding for generation, and a pad token: pad may equal EOS (SmolLM2's is
    <|im_end|>); completion masks come from the first sampled EOS, not from pad ids, so the
    EOS the policy sampled stays in the loss (rollout.completion_mask)."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


# ---- bf16 autocast: only where it is faster ----

def bf16_matmul_is_faster(n: int = 512, repeats: int = 3) -> bool:
    """Time one n x n matmul in bf16 and in float32 on this CPU. A CPU with bf16 instructions
    (AMX, AVX512-BF16) runs bf16 about twice as fast; one without them emulates it, and then
    bf16 is far slower (`python -m tools.bench bf16` measures it; docs/performance.md has the
    figures of this project's machine)."""
    def best(dtype):
        a = torch.randn(n, n).to(dtype)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t0)
        return min(times)
    return best(torch.bfloat16) < best(torch.float32)


def autocast_choice(choice: str, device: str, real_model: bool) -> bool:
    """--bf16 auto|on|off -> whether to run forwards under bf16 autocast (weights stay
    float32, log-probs are taken in float32: logprobs.head_logits). auto: always on a GPU;
    on a CPU only for a real model (the tiny one's matrices are too small to gain, and its
    lessons were recorded in float32) and only where a bf16 matmul is measured faster."""
    if choice != "auto":
        return choice == "on"
    if device == "cuda":
        return True
    return real_model and bf16_matmul_is_faster()


# ---- the policy a run starts from ----

def load(cfg, task, device: str, log, init: dict | None = None):
    """The policy RL starts from and its tokenizer, on device, dropout off: a real model (cfg.model)
    or the tiny one, warm-started on the task's mix; with --init-from (init: its pinned
    checkpoint), that run's weights. cfg: running/config.Config."""
    transformers.utils.logging.set_verbosity_error()           # its warnings and bars, off for the run
    transformers.utils.logging.disable_progress_bar()
    default = warm_start.DEFAULTS["real" if cfg.model else "tiny"]
    warm = warm_start.WarmStart(default.steps if cfg.sft_steps == -1 else cfg.sft_steps, default.lr,
                                 default.batch, 0, cfg.sft_difficulty, default.micro_batch)
    if cfg.model:
        folder = pretrained.resolve(cfg.model, pretrained.default_cache(), log)
        # fp32 weights even on a GPU (bf16 is autocast): AdamW steps of lr 1e-6 on bf16
        # weights would mostly round away.
        model, tok = real_policy(task, folder, warm, Path(cfg.cache_dir), device, log)
    else:
        model, tok = tiny_policy(task, cfg.hidden, cfg.layers, warm, Path(cfg.cache_dir), log)
    if init:                       # a second stage: another run's weights replace the warm start
        try:
            model.load_state_dict(read_weights(Path(init["path"]), model))
        except ValueError as e:
            raise ModelError(f"--init-from: {init['path']!r}: {e}") from e
        log(f"--init-from: the policy starts from {init['path']}")
    off = logprobs.disable_dropout(model)   # RL's ratios and KLs need a deterministic forward
    if off:
        log(f"dropout: switched off in {off} places for RL")
    return model.to(device), tok


def export(model, tok, folder: Path) -> None:
    """model and tok as a folder plain transformers loads (AutoModelForCausalLM, AutoTokenizer). The
    tiny model goes out as the Llama it equals: transformers 5 gives every qwen2 folder the Qwen2
    tokenizer class, which reads our word-level tokenizer.json as byte pairs (72 of 72 task texts came
    back changed); a llama folder keeps its tokenizer as saved, and a Llama with Qwen2's q, k, v biases
    and an o_proj bias of zeros computes the same logits (tests/test_survive.py)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if model.config.model_type != "qwen2" or type(tok).__name__ not in GENERIC_TOKENIZERS:
        return
    q = model.config
    shared = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
              "rope_parameters", "pad_token_id", "bos_token_id", "eos_token_id")
    weights = load_file(folder / "model.safetensors")
    for i in range(q.num_hidden_layers):
        weights[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(q.hidden_size)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    LlamaConfig(**{k: getattr(q, k) for k in shared}, attention_bias=True).save_pretrained(folder)


def read_weights(ckpt: Path, model) -> dict:
    """The checkpoint's weights as model's float32 state dict; ValueError if another model's. The
    tiny model's checkpoint (a Llama, export) back as its Qwen2: the o_proj biases, all zero, dropped."""
    from transformers import AutoModelForCausalLM          # here, not at the top: --help need not import it
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True, dtype=torch.float32)
    weights = loaded.state_dict()
    if loaded.config.model_type == "llama" and model.config.model_type == "qwen2":
        zero = {k for k, v in weights.items() if k.endswith("o_proj.bias") and not v.any()}
        weights = {k: v for k, v in weights.items() if k not in zero}
    if set(weights) != set(model.state_dict()):
        raise ValueError("its weights do not match the model")
    return weights
