"""--tensorboard: every number of metrics.jsonl also a TensorBoard scalar at its step, the
JSON lines unchanged; without the optional package, one line and exit 2 before any work."""
import json
import sys
import types

import pytest

from conftest import quick
from running import config


class FakeWriter:
    """torch.utils.tensorboard.SummaryWriter's three calls, recorded."""
    made = []

    def __init__(self, folder, purge_step=None):
        self.folder, self.scalars, self.closed, self.purge_step = folder, [], False, purge_step
        FakeWriter.made.append(self)

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_tensorboard_mirrors_every_number_of_metrics_jsonl(tmp_path, monkeypatch):
    from running import config
    import train
    monkeypatch.setattr(config, "has_tensorboard", lambda: True)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    train.train(config.parse_config(quick(tmp_path, "tb", "--tensorboard")))
    writer = FakeWriter.made[-1]
    assert writer.folder == str(tmp_path / "tb" / "tensorboard") and writer.closed
    rows = [json.loads(line) for line in open(tmp_path / "tb" / "metrics.jsonl")]
    expected = [(k, v, r["step"]) for r in rows for k, v in r.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"]
    assert writer.scalars == expected and ("completions/mean_length", rows[1]["completions/mean_length"], 1) in expected


def test_without_the_package_tensorboard_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from running import config
    monkeypatch.setattr(config, "has_tensorboard", lambda: False)
    with pytest.raises(SystemExit) as e:
        config.parse_config(quick(tmp_path, "tb", "--tensorboard"))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == ("train.py: error: --tensorboard: needs the tensorboard package, an "
                                         "optional dependency: pip install tensorboard==2.21.0")
    assert not (tmp_path / "tb").exists()


def test_a_resumed_run_purges_the_abandoned_steps_from_tensorboard(tmp_path, monkeypatch):
    """After --resume, TensorBoard kept the abandoned history's values: two a step redone."""
    from running import config
    import train
    monkeypatch.setattr(config, "has_tensorboard", lambda: True)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    train.train(config.parse_config(quick(tmp_path, "tb", "--tensorboard", "--save-every", "2")))
    assert FakeWriter.made[-1].purge_step is None
    train.train(config.parse_config(["--resume", str(tmp_path / "tb"), "--steps", "5"]))
    assert FakeWriter.made[-1].purge_step == 3           # the run's newest checkpoint is step 2


def test_a_writer_that_cannot_start_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    from running import config
    import train

    def refuses(folder, **kw):
        raise PermissionError(13, "Permission denied", folder)
    monkeypatch.setattr(config, "has_tensorboard", lambda: True)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=refuses))
    summary = train.train(config.parse_config(quick(tmp_path, "tb", "--tensorboard")))
    assert summary["steps"] == 3 and "--tensorboard: cannot write to" in capsys.readouterr().err



def test_a_disk_that_fills_while_tensorboard_writes_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """The events file cannot grow at step 2 (OSError 28): one line, the mirror stops, the run
    ends as usual with every step in metrics.jsonl; closing the writer cannot fail the run either."""
    from running import config
    import train

    class FillsUp(FakeWriter):
        def add_scalar(self, key, value, step):
            if step >= 2:
                raise OSError(28, "No space left on device")
            super().add_scalar(key, value, step)

        def close(self):
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(config, "has_tensorboard", lambda: True)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FillsUp))
    summary = train.train(config.parse_config(quick(tmp_path, "tb", "--tensorboard")))
    err = capsys.readouterr().err
    assert summary["steps"] == 3 and summary["stopped"] is None and "Traceback" not in err
    assert err.count("--tensorboard: stopped at step 2 (OSError") == 1
    rows = [json.loads(line) for line in open(tmp_path / "tb" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and {s for _, _, s in FakeWriter.made[-1].scalars} == {0, 1}
