"""The trainer's callbacks: a user callback sees every hook in order and can stop the run; callbacks
named in `train.callbacks` are built at start (a bad name is one line); the Weights & Biases callback
(offline mode, a real `wandb` run file) mirrors what `metrics.jsonl` logs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from megatron_lev.training.hooks import Callback, Control
from megatron_lev.training.metrics import METRICS_FILE, read_metrics
from tests.training.conftest import run_train, tiny_overrides

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ W&B run files (offline mode)

_BLOCK, _HEADER = 32768, 7  # the run file is a LevelDB-style log: 32 KiB blocks, 7-byte record headers


def wandb_records(path: Path):
    """The raw records of a `run-*.wandb` file (what `wandb sync` uploads)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pieces = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:  # a whole record
            yield chunk
        elif kind == 2:  # first, middle, last pieces of a record spanning blocks
            pieces = chunk
        elif kind == 3:
            pieces += chunk
        elif kind == 4:
            yield pieces + chunk


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """step -> the values logged at that step, read back from the offline run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    out: dict[int, dict] = {}
    for raw in wandb_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
        }
        out.setdefault(row["_step"], {}).update(row)
    return out


def test_wandb_offline_mirrors_the_logged_metrics(tmp_path, minipile_prefix, tokenizer_path):
    pytest.importorskip("wandb", reason="the optional wandb package is not installed (pip install wandb)")
    out = tmp_path / "run"
    overrides = tiny_overrides(
        minipile_prefix,
        tokenizer_path,
        out,
        **{
            "train.train_iters": 4,
            "train.eval_interval": 2,
            "train.eval_iters": 1,
            "logging.log_interval": 2,
            "logging.wandb_project": "megatron-lev-test",
            "logging.wandb_mode": "offline",
        },
    )
    wandb_env = {
        k: str(tmp_path / "wandb-home" / k) for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")
    }
    proc = run_train(1, overrides, WANDB_SILENT="true", WANDB_DIR=str(out), **wandb_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    history = wandb_history(run_dir)
    rows = read_metrics(out / METRICS_FILE)
    train = {r["iteration"]: r for r in rows if r["kind"] == "train"}
    valid = {r["iteration"]: r for r in rows if r["kind"] == "valid"}
    assert sorted(train) == [2, 4] and sorted(valid) == [2, 4]
    for it, row in train.items():
        assert history[it]["train/loss"] == pytest.approx(row["loss"], rel=1e-12)
        assert history[it]["train/lr"] == pytest.approx(row["lr"], rel=1e-12)
    for it, row in valid.items():
        assert history[it]["valid/loss"] == pytest.approx(row["loss"], rel=1e-12)
        assert history[it]["valid/ppl"] == pytest.approx(row["ppl"], rel=1e-12)


def test_wandb_without_the_package_is_one_config_error(monkeypatch):
    import builtins

    from megatron_lev.config import RunConfig
    from megatron_lev.errors import ConfigError
    from megatron_lev.training.wandb_logger import WandbLogger

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ConfigError, match=r"logging\.wandb_project is set but the wandb package"):
        WandbLogger(RunConfig())


def test_wandb_mode_is_checked():
    from megatron_lev.config import RunConfig
    from megatron_lev.errors import ConfigError

    cfg = RunConfig()
    cfg.logging.wandb_mode = "cloud"
    with pytest.raises(ConfigError, match=r"logging\.wandb_mode='cloud'"):
        cfg.logging.validate()


# ------------------------------------------------------------------ a user callback, in process


class Recorder(Callback):
    """Records the hooks it sees; stops the run after `stop_at` with exit code 5."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.events: list[tuple] = []
        self.stop_at = stop_at

    def on_train_begin(self, trainer, control):
        self.events.append(("begin", trainer.state.iteration))

    def on_step_begin(self, trainer, iteration):
        self.events.append(("step", iteration))

    def on_step_end(self, trainer, iteration, skipped, control: Control):
        if iteration == self.stop_at:
            control.request_stop(5, "user stop", save=False)

    def on_step_values(self, trainer, record, control):
        self.events.append(("values", record.iteration, record.loss))

    def on_log(self, trainer, iteration, values):
        self.events.append(("log", iteration, values["loss"]))

    def on_train_end(self, trainer, result):
        self.events.append(("end", result.iteration, result.exit_code, result.reason))


def _recorded(stop_at):
    """Runs in a spawned gloo process: a ToyLM trainer with the default callbacks plus a Recorder."""
    import tempfile

    from tests.training.toy import toy_config, toy_trainer

    cfg = toy_config(0, iters=5)
    cfg.logging.log_interval = 2
    out = tempfile.mkdtemp()
    trainer = toy_trainer(cfg, out, init_seed=0)
    rec = Recorder(stop_at)
    trainer.callbacks.append(rec)
    result = trainer.train()
    saved = sorted(p.name for p in (Path(out) / "ckpt").glob("iter_*"))
    return rec.events, result.losses, result.exit_code, saved


@pytest.mark.multiprocess
def test_a_user_callback_sees_every_step_in_order_and_can_stop():
    from megatron_lev.testing.distributed import run_distributed

    (full,) = run_distributed(_recorded, world_size=1, args=(None,), timeout=240)
    events, losses, exit_code, saved = full
    assert exit_code == 0 and saved == ["iter_0000005"]
    assert events[0] == ("begin", 0) and events[-1] == ("end", 5, 0, "completed")
    assert [e[1] for e in events if e[0] == "step"] == [1, 2, 3, 4, 5]
    values = [e for e in events if e[0] == "values"]
    assert [v[1] for v in values] == [1, 2, 3, 4, 5]  # every step's values, once, in order
    assert {v[1]: v[2] for v in values} == losses
    logs = [e for e in events if e[0] == "log"]
    assert [e[1] for e in logs] == [2, 4, 5]
    assert logs[0][2] == pytest.approx((losses[1] + losses[2]) / 2)  # the window's mean loss

    (stopped,) = run_distributed(_recorded, world_size=1, args=(3,), timeout=240)
    events, losses, exit_code, saved = stopped
    assert exit_code == 5 and sorted(losses) == [1, 2, 3] and saved == []
    assert events[-1] == ("end", 3, 5, "user stop")


def _initial_save_and_resume():
    """Runs in a gloo process: save_initial writes iter_0000000; resuming from it alone (the later
    checkpoint deleted) retrains the same losses."""
    import shutil
    import tempfile

    from tests.training.toy import resume, toy_config, toy_trainer

    cfg = toy_config(0, iters=3)
    cfg.train.save_initial, cfg.train.keep_last = True, 5
    out = tempfile.mkdtemp()
    first = toy_trainer(cfg, out, init_seed=0).train()
    ckpt = Path(out) / "ckpt"
    tags = sorted(p.name for p in ckpt.glob("iter_*"))
    shutil.rmtree(ckpt / "iter_0000003")
    (ckpt / "latest").write_text("iter_0000000\n")
    again = toy_trainer(cfg, out, init_seed=999)  # the weights must come from iter_0000000
    resume(again)
    resumed_from = again.state.iteration
    second = again.train()
    return tags, first.losses, resumed_from, second.losses


@pytest.mark.multiprocess
def test_save_initial_writes_iteration_zero_and_resumes_from_it():
    from megatron_lev.testing.distributed import run_distributed

    ((tags, first, resumed_from, second),) = run_distributed(
        _initial_save_and_resume, world_size=1, timeout=240
    )
    assert tags == ["iter_0000000", "iter_0000003"]
    assert resumed_from == 0
    assert second == first  # the initial weights were saved exactly


# ------------------------------------------------------------------ callbacks named in the config


def test_train_callbacks_must_be_module_colon_class():
    from megatron_lev.config import ConfigError, load_config

    assert load_config([], ["train.callbacks=[my_pkg.probes:GradProbe]"]).train.callbacks == [
        "my_pkg.probes:GradProbe"
    ]
    for bad in ("my_pkg.probes", "my_pkg.probes:", ":GradProbe", "my pkg:GradProbe", "a:b:C"):
        with pytest.raises(ConfigError, match=r"train\.callbacks\[0\]=.*must be 'module:Class'"):
            load_config([], [f"train.callbacks=[{bad!r}]"])


def test_named_callbacks_are_built_with_no_arguments_and_bad_names_are_one_line_errors(monkeypatch):
    from megatron_lev.config import ConfigError
    from megatron_lev.testing.faults import INJECT_NAN_ENV, FaultInjection
    from megatron_lev.training.hooks import callbacks_from_specs

    monkeypatch.setenv(INJECT_NAN_ENV, "2,3")
    (built,) = callbacks_from_specs(["megatron_lev.testing.faults:FaultInjection"])
    assert isinstance(built, FaultInjection) and built.nan_steps == {2, 3}
    cases = {
        "no_such_module_xyz:Probe": r"cannot import 'no_such_module_xyz' .*ModuleNotFoundError",
        "megatron_lev.testing.faults:Nope": r"'megatron_lev.testing.faults' has no 'Nope'",
        "megatron_lev.testing.faults:NaNInjector": r"is not a Callback class",
        "megatron_lev.training.callbacks:Validation": r"building .*failed \(TypeError: .*no arguments",
    }
    for spec, pattern in cases.items():
        with pytest.raises(ConfigError, match=r"^train\.callbacks: .*" + pattern) as info:
            callbacks_from_specs([spec])
        assert spec in str(info.value) and "\n" not in str(info.value)


def test_a_callback_that_does_not_import_stops_train_at_start_in_one_line(tmp_path, tokenizer_path):
    res = run_train(
        1,
        [
            "train.callbacks=[no_such_module_xyz:Probe]",
            f"data.data_path=[{tmp_path / 'nothing'}]",
            f"data.tokenizer_path={tokenizer_path}",
            f"logging.output_dir={tmp_path / 'run'}",
        ],
        timeout=120,
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(lines) == 1 and "train.callbacks" in lines[0] and "no_such_module_xyz:Probe" in lines[0], lines
    assert not (tmp_path / "run").exists()
