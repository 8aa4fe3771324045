"""Checkpoints: full-state round trip (RNG bitwise), atomicity, corrupt folders ignored, pruning, no
unpickling of what a checkpoint folder holds."""

import json
import os
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import jetrl.train.checkpoint as ckpt_mod
from jetrl.train.checkpoint import (
    MARKER, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint, verify_checkpoint,
)
from jetrl.train.optim import MasterWeightAdamW, build_lr_scheduler


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.embed.weight  # tied, as in small Llama/Qwen checkpoints

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.proj(self.embed(ids))))


def make_run(seed=0):
    torch.manual_seed(seed)
    model = TiedLM().to(torch.bfloat16)
    opt = MasterWeightAdamW(model.parameters(), lr=1e-3)
    sched = build_lr_scheduler(opt, 3, 20, "cosine")
    return model, opt, sched


def train_steps(model, opt, sched, k):
    for _ in range(k):
        ids = torch.randint(0, 32, (4, 5))
        model(ids).float().logsumexp(-1).mean().backward()
        opt.gather_grads()
        opt.step()
        opt.zero_grad()
        sched.step()


def save(root, step, model, opt, sched, **kw):
    return save_checkpoint(root, step, model=model, optimizer=opt, scheduler=sched,
                           trainer_state={"data": {"epoch": 1, "offset": 7}, "metrics_cursor": 1234}, **kw)


def test_round_trip_restores_everything(tmp_path):
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 3)
    path = save(tmp_path, 3, model, opt, sched)
    assert path.name == "step_00000003" and verify_checkpoint(path, checksums=True) is None
    draws = (random.random(), np.random.rand(3).tolist(), torch.rand(4))
    train_steps(model, opt, sched, 2)
    random.random(), np.random.rand(3), torch.rand(4)  # the original run moves on

    model2, opt2, sched2 = make_run(seed=1)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    loaded = load_checkpoint(latest_checkpoint(tmp_path), model=model2, optimizer=opt2, scheduler=sched2)
    assert loaded.step == 3 and loaded.trainer_state["data"] == {"epoch": 1, "offset": 7}
    assert loaded.trainer_state["metrics_cursor"] == 1234
    # RNG states bitwise: the same draws as right after the save
    assert (random.random(), np.random.rand(3).tolist()) == draws[:2]
    assert torch.equal(torch.rand(4), draws[2])
    assert model2.lm_head.weight is model2.embed.weight  # still tied after loading
    # the resumed run continues exactly like the original one
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    train_steps(model2, opt2, sched2, 2)
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 3)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    train_steps(model, opt, sched, 2)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(opt.masters, opt2.masters):
        assert torch.equal(a, b)
    assert sched.get_last_lr() == sched2.get_last_lr()


def damage_missing_marker(path):
    (path / MARKER).unlink()


def damage_truncated(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def damage_missing_file(path):
    (path / "optimizer.pt").unlink()


def damage_bad_marker(path):
    (path / MARKER).write_text("{not json")


@pytest.mark.parametrize("damage, reason", [
    (damage_missing_marker, "no COMPLETE.json marker"),
    (damage_truncated, "model.safetensors has .* bytes, the marker recorded"),
    (damage_missing_file, "missing file optimizer.pt"),
    (damage_bad_marker, "unreadable marker"),
])
def test_latest_skips_damaged_folders_with_a_warning(tmp_path, damage, reason):
    model, opt, sched = make_run()
    good = save(tmp_path, 1, model, opt, sched)
    train_steps(model, opt, sched, 1)
    bad = save(tmp_path, 2, model, opt, sched)
    damage(bad)
    with pytest.warns(RuntimeWarning, match=f"ignoring checkpoint .*step_00000002: {reason}"):
        assert latest_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="cannot load checkpoint"):
        load_checkpoint(bad, model=model)


def flip_a_bit(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("fname", ["optimizer.pt", "model.safetensors"])
def test_same_size_corruption_falls_back_to_the_previous_checkpoint(tmp_path, fname):
    """One flipped bit keeps every size: resume (latest_checkpoint, checksums on by default) catches it by
    the recorded SHA-256 and takes the previous complete checkpoint, with a warning."""
    model, opt, sched = make_run()
    good = save(tmp_path, 1, model, opt, sched)
    bad = save(tmp_path, 2, model, opt, sched)
    flip_a_bit(bad / fname)
    assert latest_checkpoint(tmp_path, checksums=False) == bad  # sizes match: only the checksum tells
    with pytest.warns(RuntimeWarning, match=f"ignoring checkpoint .*step_00000002: {fname} does not match its "
                                            "recorded SHA-256"):
        assert latest_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="does not match its recorded SHA-256"):
        load_checkpoint(bad, model=model)  # loading a named folder verifies it too


def test_every_pt_file_loads_with_weights_only(tmp_path):
    model, opt, sched = make_run()
    train_steps(model, opt, sched, 2)
    path = save(tmp_path, 2, model, opt, sched)
    names = sorted(p.name for p in path.glob("*.pt"))
    assert names == ["optimizer.pt", "rng.pt", "scheduler.pt"]
    for name in names:
        torch.load(path / name, weights_only=True)  # raises on anything but tensors and plain containers
    assert json.loads((path / MARKER).read_text())["format_version"] == 2


class _CreatesAFile:
    """A pickle payload: unpickling it creates ``self.target`` (stands for arbitrary code)."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def _replace_file(path, fname, obj):
    """Overwrite ``fname`` with ``obj`` and re-record it in the marker, as a crafted folder would."""
    import hashlib

    torch.save(obj, path / fname)
    marker = json.loads((path / MARKER).read_text())
    data = (path / fname).read_bytes()
    marker["files"][fname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("fname", ["rng.pt", "scheduler.pt", "optimizer.pt"])
def test_a_crafted_pickle_is_refused_and_never_runs(tmp_path, fname):
    model, opt, sched = make_run()
    path = save(tmp_path, 1, model, opt, sched)
    target = tmp_path / "pwned"
    _replace_file(path, fname, {"torch": _CreatesAFile(target)})
    before = [p.detach().clone() for p in model.parameters()]
    assert latest_checkpoint(tmp_path) == path  # consistent marker: integrity is not the defence here
    with pytest.raises(ValueError, match=f"refusing to unpickle .*{fname}.*allow_pickle=True"):
        load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    assert not target.exists()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing loaded before refusing


def test_an_old_pickled_checkpoint_loads_only_with_allow_pickle(tmp_path):
    """Format version 1 stored python's and numpy's RNG states as pickled tuples (numpy arrays)."""
    model, opt, sched = make_run()
    path = save(tmp_path, 1, model, opt, sched)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    old_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    draws = (random.random(), np.random.rand(2).tolist(), torch.rand(2))
    _replace_file(path, "rng.pt", old_rng)
    with pytest.raises(ValueError, match="refusing to unpickle"):
        load_checkpoint(path, model=model)
    load_checkpoint(path, model=model, allow_pickle=True)
    assert (random.random(), np.random.rand(2).tolist()) == draws[:2] and torch.equal(torch.rand(2), draws[2])


def test_a_save_that_fails_midway_leaves_nothing(tmp_path, monkeypatch):
    model, opt, sched = make_run()
    good = save(tmp_path, 1, model, opt, sched)
    real_save = torch.save

    def failing_save(obj, f, *a, **kw):
        if str(f).endswith("scheduler.pt"):
            raise OSError("disk full")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(ckpt_mod.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 2, model, opt, sched)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    assert latest_checkpoint(tmp_path) == good


def test_a_killed_save_leaves_only_an_ignored_temp_folder(tmp_path):
    model, opt, sched = make_run()
    good = save(tmp_path, 1, model, opt, sched)
    leftover = tmp_path / ".tmp-step_00000002-4242"  # what SIGKILL during a save leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == good
    save(tmp_path, 2, model, opt, sched)  # the next save of that step clears it
    assert not leftover.exists()


def test_keep_last_and_resave(tmp_path):
    model, opt, sched = make_run()
    for step in range(1, 6):
        save(tmp_path, step, model, opt, sched, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    path = save(tmp_path, 5, model, opt, sched, keep_last=2)  # a step saved again replaces the folder
    assert verify_checkpoint(path) is None and [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_custom_model_save_and_errors(tmp_path):
    model, opt, sched = make_run()

    def save_hf(folder):
        (folder / "hf").mkdir()
        (folder / "hf" / "config.json").write_text(json.dumps({"hidden_size": 16}))
        torch.save(model.state_dict(), folder / "hf" / "weights.pt")

    path = save_checkpoint(tmp_path, 7, save_model=save_hf, trainer_state={"x": 1})
    marker = json.loads((path / MARKER).read_text())
    assert "hf/config.json" in marker["files"] and verify_checkpoint(path, checksums=True) is None
    seen = []
    load_checkpoint(path, load_model=seen.append)
    assert seen == [path]
    with pytest.raises(FileNotFoundError, match="custom save_model"):
        load_checkpoint(path, model=model)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, 8, model=model, trainer_state={"t": torch.zeros(1)})
    assert latest_checkpoint(tmp_path) == path
    other = nn.Linear(3, 3)
    good = save(tmp_path, 9, model, opt, sched)
    with pytest.raises(ValueError, match="does not match the model"):
        load_checkpoint(good, model=other)
    assert os.path.isdir(good)


@pytest.mark.parametrize("damage", [damage_missing_marker, damage_truncated, damage_missing_file])
def test_resume_must_refuses_a_folder_of_damaged_checkpoints(tmp_path, damage):
    """``--resume=must`` needs a checkpoint it can resume from: a folder holding only damaged ones is an error before
    the model loads (it would otherwise restart at step 0 and empty the metrics log); plain ``--resume`` warns."""
    from jetrl.train.policy import check_resumable

    model, opt, sched = make_run()
    bad = save(tmp_path, 3, model, opt, sched)
    damage(bad)
    with pytest.raises(FileNotFoundError, match="every checkpoint in .* is incomplete or damaged .*step_00000003"):
        check_resumable(tmp_path, require_checkpoint=True)
    with pytest.warns(RuntimeWarning, match="nothing to resume"):
        assert check_resumable(tmp_path, require_checkpoint=False) is False
    save(tmp_path, 1, model, opt, sched)
    assert check_resumable(tmp_path, require_checkpoint=True)
