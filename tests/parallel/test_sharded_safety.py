"""Loading a sharded (DCP) checkpoint runs no code from the folder: a crafted ``.metadata`` is refused before
DCP unpickles it, and non-tensor entries are neither written nor read."""

import pickle

import pytest
import torch
import torch.nn as nn

from jetrl.parallel.checkpoint import UnsafeCheckpointError, check_metadata, load_sharded, save_sharded


class _Payload:
    """Unpickling this creates a file: what a crafted checkpoint would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_round_trip_and_metadata_passes(tmp_path):
    model, other = nn.Linear(8, 4), nn.Linear(8, 4)
    save_sharded(tmp_path / "ck", model, {"w.exp_avg": torch.randn(4, 8)})
    check_metadata(tmp_path / "ck" / ".metadata")  # DCP's own metadata is allowed
    state = {"w.exp_avg": torch.zeros(4, 8)}
    load_sharded(tmp_path / "ck", other, state)
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    model = nn.Linear(8, 4)
    save_sharded(tmp_path / "ck", model)
    marker = tmp_path / "pwned"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(UnsafeCheckpointError, match="refusing to load"):
        load_sharded(tmp_path / "ck", nn.Linear(8, 4))
    assert not marker.exists()


@pytest.mark.parametrize("module, name", [("torch.distributed.checkpoint.metadata", "os.system"),
                                          ("torch.distributed.checkpoint.metadata", "Any"), ("torch", "os.system")])
def test_metadata_refuses_names_its_modules_only_import(tmp_path, module, name):
    """Pickle protocol 4 resolves a dotted name through a module's imports ("os.system" via the DCP metadata
    module's ``os``): only classes defined in DCP's metadata module pass, so a crafted file runs nothing."""
    model = nn.Linear(8, 4)
    save_sharded(tmp_path / "ck", model)
    marker = tmp_path / "pwned"

    def text(x):
        return b"\x8c" + bytes([len(x)]) + x.encode()

    payload = b"\x80\x04" + text(module) + text(name) + b"\x93" + text(f"touch {marker}") + b"\x85R."
    (tmp_path / "ck" / ".metadata").write_bytes(payload)
    with pytest.raises(UnsafeCheckpointError, match="refusing to load"):
        load_sharded(tmp_path / "ck", nn.Linear(8, 4))
    assert not marker.exists()


def test_non_tensor_entries_are_not_written_nor_read(tmp_path):
    with pytest.raises(TypeError, match="tensors only; optim.step is a int"):
        save_sharded(tmp_path / "a", nn.Linear(8, 4), {"step": 3})
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": nn.Linear(8, 4).state_dict(), "extra": {"note": "x"}}, checkpoint_id=str(tmp_path / "b"),
             no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="non-tensor entries"):
        check_metadata(tmp_path / "b" / ".metadata")
