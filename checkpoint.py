"""What survives a crash: append-only logs, atomic checkpoints, exact resume.

Logs. metrics.jsonl and samples.jsonl are written one line per `os.write` call, straight to
the file (no Python buffer), so a run killed at any moment (`kill -9` included) leaves a
file whose every line is a complete JSON object for a finished step.

Checkpoints. RUN/checkpoints/step-000040/ holds the policy written with `save_pretrained`
(plus its tokenizer), so plain transformers loads it:

    AutoModelForCausalLM.from_pretrained("RUN/checkpoints/step-000040")

and trainer_state.pt with everything else a resumed run needs to continue *exactly*: the
optimizer's state, the loop's counters, the monitor's state and every random number
generator's state. It is written into step-000040.tmp/ and renamed into place, so a crash
mid-write never leaves half a checkpoint under the final name.

Resume. `python train.py --resume RUN` loads the newest checkpoint, cuts the logs back to the
steps it covers, and goes on; on the CPU the metrics equal those of an uninterrupted run.
"""
import json
import os
import random
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

STATE_FILE = "trainer_state.pt"


# ---- crash-safe logs ----

class JsonlLog:
    """Append-only JSON-lines file: one complete line per os.write, nothing buffered."""

    def __init__(self, path: Path, append: bool):
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        self.fd = os.open(path, flags, 0o644)

    def write(self, row: dict) -> None:
        data = (json.dumps(row) + "\n").encode()
        while data:                       # os.write may write less than asked; finish the line
            data = data[os.write(self.fd, data):]

    def close(self) -> None:
        os.close(self.fd)


def truncate_log(path: Path, last_step: int) -> None:
    """Keep the lines of steps <= last_step (a resumed run redoes the rest)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


# ---- checkpoints ----

def save(run_dir: Path, step: int, model, tok, optimizer, loop_state: dict,
         rng: random.Random) -> Path:
    """Write RUN/checkpoints/step-NNNNNN atomically; return its path."""
    final = Path(run_dir) / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)                # left by a crash during an earlier save
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "loop": loop_state,
                "python_rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
               tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)                # the rename is the commit point
    return final


def find(path: Path) -> Path | None:
    """The checkpoint at `path` itself, or the newest complete one under path/checkpoints."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    done = [p for p in (path / "checkpoints").glob("step-*")
            if not p.name.endswith(".tmp") and (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: p.name) if done else None


def run_dir_of(ckpt: Path) -> Path:
    return Path(ckpt).parent.parent       # RUN/checkpoints/step-N -> RUN


def restore(ckpt: Path, model, optimizer, rng: random.Random) -> dict:
    """Load weights, optimizer and RNG states from a checkpoint; return its loop state."""
    saved = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True, dtype=torch.float32)
    model.load_state_dict(saved.state_dict())
    state = torch.load(Path(ckpt) / STATE_FILE, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    rng.setstate(_as_tuple(state["python_rng"]))
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return {**state["loop"], "step": state["step"]}


def _as_tuple(x):
    # random.setstate wants tuples all the way down; torch.load may hand back lists.
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
