"""What survives a crash (docs/faults.md): logs of whole JSON lines, one per os.write; checkpoints
RUN/checkpoints/step-NNNNNN/, the weights as save_pretrained writes them and trainer_state.pt, one
dict with the rest (optimizer, loop, controllers, random generators), written beside and renamed
into place. `--resume RUN` loads the newest whole one; on the CPU the metrics equal an
uninterrupted run's.
"""
import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
from pathlib import Path

import torch

import lora
from models import policy

STATE_FILE = "trainer_state.pt"


# ---- crash-safe logs ----

def finite_json(row: dict) -> tuple[dict, list]:
    """The row with every NaN/inf float as null (bare NaN is not JSON), and the keys that held one."""
    bad = []

    def clean(x, key):
        if isinstance(x, float) and not math.isfinite(x):
            bad.append(key)
            return None
        if isinstance(x, dict):
            return {k: clean(v, f"{key}.{k}" if key else k) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v, key) for v in x]
        return x
    return clean(row, ""), bad


def write_whole(path: Path, text: str) -> None:
    """path's new contents, whole or not at all: written beside it, renamed over it."""
    tmp = Path(path).with_name(f"{Path(path).name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# a write refused for want of room: a full disk, a quota, a file-size limit (ulimit -f, FAT32's 4 GB)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
RESERVE = ".reserve"


def reserve(run_dir: Path, nbytes: int) -> bool:
    """Hold nbytes of disk in RUN/.reserve for the last checkpoint and summary (release); False: no room now."""
    path = Path(run_dir) / RESERVE
    try:
        with open(path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, nbytes)
        return True
    except OSError:
        path.unlink(missing_ok=True)
        return False


def release(run_dir: Path) -> bool:
    """Give the reserve's room back; True when there was one."""
    held = (Path(run_dir) / RESERVE).exists()
    (Path(run_dir) / RESERVE).unlink(missing_ok=True)
    return held


class JsonlLog:
    """Append-only JSON lines, one whole line per os.write; a non-finite number is written as
    null, its key listed under `nonfinite_logged`."""

    def __init__(self, path: Path, append: bool):
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        self.path, self.lost, self.full = Path(path), 0, False      # full: the disk refused a line
        self.fd = os.open(path, flags, 0o644)

    def write(self, row: dict) -> None:
        """Append one line; one the disk refuses is said, counted (self.lost) and cut off again."""
        row, bad = finite_json(row)
        if bad:
            row["nonfinite_logged"] = bad
        data = (json.dumps(row, allow_nan=False) + "\n").encode()
        start = os.lseek(self.fd, 0, os.SEEK_END)          # where this line begins
        try:
            while data:                   # os.write may write less than asked; finish the line
                data = data[os.write(self.fd, data):]
        except OSError as e:
            self.lost += 1
            self.full = self.full or e.errno in NO_ROOM
            try:                          # the part that fitted goes: the next line starts whole
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            print(f"{self.path.name}: a line was not written ({e}); {self.lost} lost so far",
                  file=sys.stderr)

    def close(self) -> None:
        os.close(self.fd)


def last_step(path: Path) -> int:
    """The step of a log's last line (after truncate_log: every line whole), -1 if none."""
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else -1


def truncate_log(path: Path, last_step: int) -> int:
    """Keep the lines of steps <= last_step; drop torn lines and return how many."""
    if not path.exists():
        return 0
    keep, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
            assert isinstance(step, int)         # {"step": null}: not a line this code wrote
        except (ValueError, KeyError, TypeError, AssertionError):
            torn += 1
            continue
        if step <= last_step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return torn


# ---- one run per folder ----

class RunBusy(ValueError):
    """Another process is running in this run folder (one line, exit 2)."""


@contextlib.contextmanager
def run_lock(run_dir: Path):
    """flock on RUN/.lock while a run writes there: a second is refused (RunBusy); a killed one leaves no lock."""
    fd = os.open(Path(run_dir) / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunBusy(f"--out: another run is writing in {str(run_dir)!r} now; wait for it, or choose another --out") from None
    try:
        yield
    finally:
        os.close(fd)                         # closing the file releases the lock


def clear_run(run_dir: Path, names) -> None:
    """--overwrite: delete the earlier run's files (and nothing else) from run_dir."""
    for name in names:
        path = Path(run_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# ---- signals ----

SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}


class Interrupts:
    """SIGINT and SIGTERM noted, not obeyed mid-step: the loop finishes its step, saves, writes the
    summary (`interrupted`), exits 128 + the signal. A second one stops at once, and so does the
    first while a run is set up (at_once: SIGTERM's default killed it without a word). Main thread only."""

    def __init__(self, log=print, at_once: bool = False):
        self.signal, self.log, self.at_once = None, log, at_once
        main = threading.current_thread() is threading.main_thread()
        self.saved = {sig: signal.signal(sig, self._handle) for sig in SIGNALS.values()} if main else {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal or self.at_once:                     # the second one, or one during set-up: stop now
            raise KeyboardInterrupt(name)
        self.signal = name
        self.log(f"{name}: finishing this step, then saving a checkpoint and stopping "
                 f"(send it again to stop at once)")

    def restore(self) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        self.saved = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


# ---- checkpoints ----

def save(run_dir: Path, step: int, model, tok, whole: dict, rng: random.Random) -> Path:
    """Write RUN/checkpoints/step-NNNNNN whole or not at all: the weights, the tokenizer and
    trainer_state.pt (`whole`, the step, every random generator's state)."""
    final = Path(run_dir) / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)                # left by a crash during an earlier save
    try:
        tmp.mkdir(parents=True)
        policy.export(model, tok, tmp)
        torch.save({"step": step, **whole, "python_rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                   tmp / STATE_FILE)
        _fsync(*[p for p in tmp.rglob("*") if p.is_file()], tmp)   # the bytes on disk before the rename ...
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)   # a full disk: no half checkpoint left behind
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)                # the rename is the commit point
    _fsync(final.parent)                  # ... and the rename itself: a power cut or an OS
    return final                          # crash then leaves the old or the new checkpoint, whole


def _fsync(*paths: Path) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def prune(run_dir: Path, keep: int, spare: Path | None = None) -> list[Path]:
    """Delete all but the `keep` newest checkpoints (0: none), never `spare`; return them."""
    if keep <= 0:
        return []
    old = [p for p in candidates(run_dir)[keep:] if spare is None or p.resolve() != Path(spare).resolve()]
    for p in old:
        shutil.rmtree(p)
    return old


def candidates(path: Path) -> list[Path]:
    """The checkpoint at `path` itself, or the complete ones under path/checkpoints, newest first."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return [path]
    done = [p for p in (path / "checkpoints").glob("step-*")
            if not p.name.endswith(".tmp") and (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: p.name, reverse=True)


def find(path: Path) -> Path | None:
    """The checkpoint at `path` itself, or the newest complete one under path/checkpoints."""
    return next(iter(candidates(path)), None)


def starting_point(run_dir: Path) -> Path | None:
    """--init-from's checkpoint: the best the summary names (early stopping), else the newest."""
    try:
        best = Path(run_dir) / json.loads((Path(run_dir) / "summary.json").read_text())["best_checkpoint"]
        return best if (best / STATE_FILE).is_file() else find(run_dir)
    except (OSError, ValueError, TypeError, KeyError):
        return find(run_dir)


def is_busy(run_dir: Path) -> bool:
    """Whether a run is writing in run_dir now (it holds RUN/.lock). The probe's lock is a shared
    one, so two runs checking the same parent at once never take each other's probe for a run."""
    if not (Path(run_dir) / ".lock").exists():
        return False
    fd = os.open(Path(run_dir) / ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def weights_sha256(ckpt: Path) -> str:
    """The sha256 of a checkpoint's weight files, in name order: what pins --init-from's start."""
    digest = hashlib.sha256()
    for p in sorted(Path(ckpt).glob("*.safetensors")) + sorted(Path(ckpt).glob("*.bin")):
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def set_aside_later(run_dir: Path, step: int) -> tuple[Path | None, list[str]]:
    """One folder, one history: resumed from an older checkpoint, the later whole ones move (never
    deleted) to checkpoints.abandoned-after-step-N, where --resume cannot pick them. A save cut
    short (step-N.tmp, or a folder without its state file) is no history: this program's own half
    write, removed. Returns (that folder or None, the names removed)."""
    number = lambda p: p.name.split("-")[-1].split(".")[0]                 # step-000012(.tmp) -> 000012
    later = [p for p in Path(run_dir).glob("checkpoints/step-*") if number(p).isdigit() and int(number(p)) > step]
    cut = [p for p in later if p.name.endswith(".tmp") or not (p / STATE_FILE).is_file()]
    for p in cut:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    later = [p for p in later if p not in cut]
    if not later:
        return None, [p.name for p in cut]
    base = Path(run_dir) / f"checkpoints.abandoned-after-step-{step}"
    aside, n = base, 1
    while aside.exists():
        n += 1
        aside = Path(f"{base}-{n}")
    aside.mkdir()
    for p in later:
        p.rename(aside / p.name)
    return aside, [p.name for p in cut]


def run_dir_of(ckpt: Path) -> Path:
    return Path(ckpt).parent.parent       # RUN/checkpoints/step-N -> RUN


class ResumeError(ValueError):
    """No checkpoint of the run loads (one line, exit 2)."""


def restore_newest(path: Path, model, optimizer, rng: random.Random, log=print) -> tuple[dict, Path]:
    """(restore's dict, its path) of the newest checkpoint under path that loads whole, saying
    which damaged ones were skipped and why; else ResumeError."""
    reasons = []
    for ckpt in candidates(path):
        try:
            state = restore(ckpt, model, optimizer, rng)
        except Exception as e:          # any damage: safetensors, pickle, shape or key errors
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            log(f"resume: skipped damaged checkpoint {ckpt} ({reason})")
            reasons.append(f"{ckpt.name}: {reason}")
            continue
        return state, ckpt
    raise ResumeError(f"--resume: no checkpoint in {str(path)!r} loads ({'; '.join(reasons) or 'none found'})")


def restore(ckpt: Path, model, optimizer, rng: random.Random) -> dict:
    """Load the weights (a LoRA run's: its adapters; its files hold them merged, for export), the
    optimizer and the random generators, all or nothing; return "step", "loop", "controllers"."""
    state = torch.load(Path(ckpt) / STATE_FILE, weights_only=True)
    if "controllers" not in state:         # an older train.py's checkpoint: not read by guesswork
        raise ResumeError("written by an older version of train.py; start the run again")
    if ("adapters" in state) != bool(lora.adapters(model)):
        raise ResumeError("its run trained LoRA adapters and this one does not, or the other way round")
    weights = policy.read_weights(ckpt, model) if "adapters" not in state else None
    before = optimizer.state_dict()
    try:
        optimizer.load_state_dict(state["optimizer"])
        if weights is None:
            lora.load_adapter_state(model, state["adapters"])
        else:
            model.load_state_dict(weights)
    except (ValueError, KeyError, RuntimeError):
        optimizer.load_state_dict(before)
        raise
    rng.setstate(_as_tuple(state["python_rng"]))
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return {"step": state["step"], "loop": state["loop"], "controllers": state["controllers"]}


def _as_tuple(x):
    # random.setstate wants tuples all the way down; torch.load may hand back lists.
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
