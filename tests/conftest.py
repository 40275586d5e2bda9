"""What the tests share: the lessons (the top-level modules) on the path, the update loop with
GRPO's or PPO's loss, a tiny model, a synthetic batch of rollouts, and the flags of a run of a
few seconds. Test files import the helpers
(`from conftest import tiny_model`); pytest loads this file first."""
import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))

import grpo  # noqa: E402  (after the path)
import logprobs  # noqa: E402
import ppo  # noqa: E402
import update  # noqa: E402
from models import policy  # noqa: E402
from rollout import Rollout, completion_mask  # noqa: E402


@pytest.fixture(autouse=True)
def sigterm_stops_the_suite(monkeypatch):
    """A test that trains in-process catches SIGTERM (checkpoint.Interrupts: finish the step,
    save, stop) and its run ends cleanly; the suite then went on as if nothing had been asked.
    Here the suite stops after that test, exit 143, as it would on SIGTERM anywhere else."""
    from running import checkpoint
    caught, restore = [], checkpoint.Interrupts.restore

    def restore_and_note(self):
        caught.append(self.signal == "SIGTERM")
        restore(self)
    monkeypatch.setattr(checkpoint.Interrupts, "restore", restore_and_note)
    yield
    if any(caught):
        pytest.exit("SIGTERM: a test's run caught it, saved and stopped; the suite stops here", returncode=143)


def pytest_configure(config):
    config.addinivalue_line("markers", "lesson: a lesson's demonstration against its reference; "
                                       "`python -m pytest -q -m lesson` runs them alone in about a minute")
    config.addinivalue_line("markers", "slow: minutes each (the whole quick lab, SmolLM2's warm start and RL "
                                       "steps): left out of `python -m pytest -q` so CI fits in 12 minutes on "
                                       "2 cores; `python -m pytest -q -m slow` runs them")


def pytest_collection_modifyitems(config, items):
    """The slow tier stays out unless asked for: by -m (`-m slow`, `-m "slow or not slow"`) or by
    naming the tests (a file or a test id on the command line runs what it names)."""
    if config.getoption("markexpr") or config.args_source == pytest.Config.ArgsSource.ARGS:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def grpo_update(scorer, optimizer, batch, hp):
    """update.py's loop with GRPO's loss (train.py picks it by --algo)."""
    return update.update(scorer, optimizer, batch, hp, grpo.loss)


def ppo_update(scorer, optimizer, batch, hp):
    """update.py's loop with PPO's loss."""
    return update.update(scorer, optimizer, batch, hp, ppo.loss)


def tiny_model(seed: int = 0):
    """A 1-layer Qwen2 over 20 tokens (pad 0, EOS 1), random weights from seed."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(seed)
    tok = policy.build_tokenizer([f"w{i}" for i in range(17)])
    return Qwen2ForCausalLM(policy.tiny_config(tok, 16, 1, 32, num_attention_heads=2, num_key_value_heads=1))


def synthetic_batch(model, n=8, p_len=4, c_len=6, eos=1, seed=0) -> Rollout:
    """n rollouts of random tokens: half the prompts left-padded, some completions ended by
    EOS; old log-probs near the model's, a reference 0.1 below them, random advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, 20, (n, p_len), generator=gen)
    prompt_mask = torch.ones(n, p_len, dtype=torch.long)
    prompt_mask[: n // 2, :2] = 0                                 # left padding on half the rows
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(2, 20, (n, c_len), generator=gen)
    completion_ids[::3, 3] = eos                                  # some rows end early
    mask = completion_mask(completion_ids, eos)
    batch = Rollout(prompt_ids, prompt_mask, completion_ids, mask, None, None, texts=[""] * n)
    with torch.no_grad():
        old, _ = logprobs.completion_logprobs(model, batch.tokens())
    batch.advantages = torch.randn(n, generator=gen)
    batch.old_logp = old + 0.05 * torch.randn(n, c_len, generator=gen)
    batch.ref_logp = old - 0.1
    return batch


def configure(argv: list):
    """config.parse_config(argv), where a knob that is a field and not a flag (--kl-horizon, a
    paper's constant: config.is_flag) is set on the parsed configuration and checked as the
    flags are (what a run resumed from a hand-edited config.json meets): one line, exit 2."""
    import dataclasses
    from running import config
    knobs = {f.name: f for f in dataclasses.fields(config.Config)}
    flags, fields, i = [], {}, 0
    while i < len(argv):
        f = knobs.get(argv[i][2:].replace("-", "_")) if argv[i].startswith("--") else None
        if f is None or config.is_flag(f):
            flags, i = flags + [argv[i]], i + 1
        elif f.type is bool or f.type == "bool":
            fields[f.name], i = True, i + 1
        else:
            fields[f.name], i = type(f.default)(argv[i + 1]), i + 2
    cfg = config.parse_config(flags)
    if not fields:
        return cfg
    cfg = dataclasses.replace(cfg, **fields)
    try:
        return config.validate(cfg, config.LESSONS)
    except config.ConfigError as e:
        config.fail(str(e))


def assert_refused_in_one_line(tmp_path, capsys, argv: list, message: str) -> None:
    """train.py's flags (quick's, plus argv) exit 2 before any work, with one line on stderr
    that holds message."""
    import pytest
    with pytest.raises(SystemExit) as e:
        configure(quick(tmp_path, "bad", *argv))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


# One warm-start cache for the whole session: each setting's warm start is built once, not once
# a test (it was ~4 s of most tests' run). A test about the cache itself gives its own
# (quick(..., own_cache=True), or a --cache-dir of its own after quick's: the last one wins).
WARM_STARTS = Path(tempfile.mkdtemp(prefix="rl-lessons-warm-starts-"))
atexit.register(shutil.rmtree, WARM_STARTS, ignore_errors=True)


def quick(tmp_path, name, *extra, own_cache: bool = False):
    """train.py flags for a few steps with a small warm-up, cached in the session's WARM_STARTS
    (own_cache: in tmp_path/cache)."""
    cache = tmp_path / "cache" if own_cache else WARM_STARTS
    return ["--steps", "3", "--batch", "2", "--k", "4", "--eval-every", "2", "--eval-samples", "1",
            "--sft-steps", "30", "--hidden", "16", "--layers", "1", "--quiet",
            "--cache-dir", str(cache), "--out", str(tmp_path / name), *extra]
