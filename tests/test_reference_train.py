"""The reference trainer: learning, the result line, determinism, resume, config errors, DDP."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from reference_model import ConfigError
from reference_model.data import BucketedLoader, build_data
from reference_model.model import build_model
from reference_model.train import RESULT_KEYS, load_config, main, train
from sfmonitor.sinks.jsonl import read_jsonl

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_few_steps_on_tiny_config_decrease_the_loss():
    cfg = load_config("tiny")
    tr, _, vocab, classes = build_data(cfg.data, cfg.model.max_len)
    torch.manual_seed(0)
    model = build_model({**cfg.model.to_dict(), "vocab_size": vocab, "num_classes": classes})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = next(iter(BucketedLoader(tr, 8, seed=0)))
    w = cfg.train.loss_weights
    first = None
    for _ in range(30):
        losses = model(**batch)
        loss = sum(w[k] * losses[k] for k in losses)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first


def test_train_returns_the_result_line_and_is_deterministic(tmp_path):
    a = train("tiny", seed=1, run_dir=str(tmp_path / "a"))
    assert set(RESULT_KEYS) <= set(a)
    assert a["config"] == "tiny" and a["seed"] == 1 and a["events"] == {} and a["actions"] == {}
    assert a["optimizer_steps"] == 2 * 4 and len(a["history"]) == 2
    assert a["first_nan_epoch"] is None and isinstance(a["diverged"], bool)
    json.dumps(a)
    b = train("tiny", seed=1)
    assert (a["val_loss"], a["final_top1"], a["history"]) == (b["val_loss"], b["final_top1"], b["history"])
    c = train("tiny", seed=2)
    assert c["history"] != a["history"]


def test_resume_continues_bit_for_bit(tmp_path):
    straight = train("tiny", seed=0, overrides={"train.epochs": 3})
    train("tiny", seed=0, run_dir=str(tmp_path), overrides={"train.epochs": 2})
    resumed = train("tiny", seed=0, resume=str(tmp_path / "checkpoint.pt"), overrides={"train.epochs": 3})
    assert resumed["history"] == straight["history"]


def test_resume_with_the_monitor_keeps_its_state(tmp_path):
    quiet = {"console": False}
    straight = train("tiny", seed=0, monitor=True, monitor_config=quiet, overrides={"train.epochs": 3})
    train(
        "tiny", seed=0, monitor=True, monitor_config=quiet, run_dir=str(tmp_path / "a"), overrides={"train.epochs": 2}
    )
    resumed = train(
        "tiny",
        seed=0,
        monitor=True,
        monitor_config=quiet,
        run_dir=str(tmp_path / "b"),
        resume=str(tmp_path / "a" / "checkpoint.pt"),
        overrides={"train.epochs": 3},
    )
    assert resumed["history"] == straight["history"]
    metrics = read_jsonl(str(tmp_path / "b" / "metrics.jsonl"))
    assert metrics[0]["step"] == 8  # the monitor's step count went on from the checkpoint


def test_main_prints_json_last_line_and_rejects_bad_keys(capsys):
    assert (
        main(["--config", "tiny", "--seed", "0", "--epochs", "1", "--no-progress", "--set", "train.optimizer=radam"])
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(line)
    assert out["config"] == "tiny" and out["optimizer_steps"] == 4
    assert main(["--config", "tiny", "--set", "model.nope=1"]) == 2
    assert "model.nope" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not found"):
        load_config("no_such_config")
    with pytest.raises(ConfigError, match="train.optimizer"):
        load_config("tiny", {"train.optimizer": "sgd"})


def test_shipped_configs_load_with_the_report_settings():
    trap, stable = load_config("trap"), load_config("stable")
    assert (trap.train.optimizer, trap.train.lr, trap.train.amp) == ("adamw", 3e-4, True)
    assert trap.train.init_scale == 65536 and trap.train.accumulation == 4
    assert trap.data.negative_share == 0.9
    assert not trap.model.length_norm and not trap.model.scaled_attention
    assert stable.model.length_norm and stable.model.scaled_attention
    assert stable.model.qk_init_gain == trap.model.qk_init_gain
    assert load_config("adamw_1e-4").train.lr == 1e-4
    radam = load_config("radam_5e-4")
    assert (radam.train.optimizer, radam.train.lr) == ("radam", 5e-4)
    assert load_config("trap", {"train.schedule": "cyclic"}).train.schedule == "cyclic"


def test_cyclic_schedule_and_clipping_run():
    r = train(
        "tiny",
        seed=0,
        overrides={
            "train.schedule": "cyclic",
            "train.max_grad_norm": 1.0,
            "train.epochs": 1,
            "model.mask_ratio": 0.15,
            "model.dropout": 0.1,
        },
    )
    assert r["optimizer_steps"] == 4 and r["val_loss"] == r["val_loss"]


def test_monitor_path_attaches_and_reports(tmp_path):
    sfmonitor = pytest.importorskip("sfmonitor")
    if not hasattr(sfmonitor, "attach"):
        pytest.skip("sfmonitor core not present yet")
    r = train("tiny", seed=0, monitor=True, run_dir=str(tmp_path), overrides={"train.epochs": 1})
    assert r["monitor"] is True and isinstance(r["events"], dict) and isinstance(r["actions"], dict)
    assert r["optimizer_steps"] == 4


def test_two_rank_gloo_ddp_run_finishes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "reference_model.train",
        "--",
        "--config",
        "tiny",
        "--seed",
        "0",
        "--no-progress",
        "--run-dir",
        str(tmp_path),
        "--monitor",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    out = json.loads(lines[0])
    assert out["world_size"] == 2 and out["optimizer_steps"] == 2 * 2
    assert (tmp_path / "checkpoint.pt").exists()
    # the monitor ran on both ranks; only rank 0 wrote its log, one line per optimizer step
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [0, 1, 2, 3]


def test_demo_prints_both_runs_side_by_side(tmp_path, capsys):
    from reference_model.demo import main as demo_main

    assert demo_main(["--config", "tiny", "--seed", "0", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| | without monitor | with monitor |" in out and "| final_top1 |" in out
    assert str(tmp_path / "bare-seed0") in out and str(tmp_path / "monitored-seed0") in out
    assert (tmp_path / "bare-seed0" / "checkpoint.pt").exists()


def test_cli_sinks_reach_the_monitor(tmp_path, capsys):
    assert (
        main(
            [
                "--config",
                "tiny",
                "--epochs",
                "1",
                "--monitor",
                "--no-progress",
                "--run-dir",
                str(tmp_path),
                "--sinks",
                "jsonl,tensorboard",
            ]
        )
        == 0
    )
    assert os.listdir(tmp_path / "tensorboard") and (tmp_path / "metrics.jsonl").exists()


def test_main_reports_a_bad_monitor_config(tmp_path, capsys):
    bad = tmp_path / "monitor.yaml"
    bad.write_text("no_such_monitor_key: 1\n")
    assert main(["--config", "tiny", "--epochs", "1", "--monitor", "--no-progress", "--monitor-config", str(bad)]) == 2
    assert "no_such_monitor_key" in capsys.readouterr().err


def test_the_progress_bar_falls_back_to_plain_lines_without_tqdm(monkeypatch, capsys):
    import sys

    from reference_model import train

    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm not installed
    bar = train._progress(2, True)
    bar.set_description("epoch 1/1")
    bar.set_postfix(loss="1.0", refresh=False)
    bar.update(1)
    bar.update(1)  # the last one always prints
    bar.close()
    assert "epoch 1/1 2/2 loss=1.0" in capsys.readouterr().err


def test_the_device_is_chosen_or_refused_with_a_clear_error(capsys):
    from reference_model.train import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="'nowhere' is not a torch device"):
        resolve_device("nowhere")
    with pytest.raises(ConfigError, match="cpu or cuda"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="sees no CUDA device"):
            resolve_device("cuda")
        assert main(["--config", "tiny", "--device", "cuda", "--no-progress"]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err
    out = train("tiny", seed=0, overrides={"train.epochs": 1}, device="cpu")
    assert out["optimizer_steps"] == 4 and math.isfinite(out["val_loss"])
