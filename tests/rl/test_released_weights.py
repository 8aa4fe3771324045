"""``jet`` holds no BF16 copy of its FP8 linears' weights: they quantize from their fp32 optimizer masters
(:func:`jetrl.train.optim.release_fp8_weights`). Same bits as keeping the copy: the training steps, the FP8 weights,
the state dict and the HuggingFace export, a resumed run; the dropped storage; what is refused."""

from __future__ import annotations

import pytest
import torch

import jetrl.rl.trainer as trainer_mod
from jetrl.models.checkpoint import _export_tensors
from jetrl.quant import FP8Linear, fp8_linears
from test_trainer import make_trainer

TIMING = ("time/", "throughput/", "memory/")


def _values(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _fp8_bytes(model) -> list[torch.Tensor]:
    out = []
    for layer in fp8_linears(model):
        q = layer.quantized_weight()
        out += [q.data.view(torch.uint8).clone(), q.scale.clone()]
    return out


def _jet(monkeypatch=None, release=True):
    if not release:
        monkeypatch.setattr(trainer_mod, "release_fp8_weights", lambda model, optimizer: 0)
    trainer = make_trainer("jet", dtype=torch.bfloat16)
    if not release:
        monkeypatch.undo()
    return trainer


def test_jet_drops_the_bf16_weights_and_trains_bitwise_as_with_them(monkeypatch):
    kept, released = _jet(monkeypatch, release=False), _jet()
    layers = fp8_linears(released.model)
    assert layers and all(layer.weight_released for layer in layers)
    assert not any(layer.weight_released for layer in fp8_linears(kept.model))
    assert kept.released_weight_bytes == 0  # reported on a GPU as memory/released_bf16_weights_gib
    assert released.released_weight_bytes == sum(2 * layer.weight.numel() for layer in layers)
    for layer in layers:  # the BF16 storage is gone: a one-element placeholder of the weight's shape
        assert layer.weight.untyped_storage().nbytes() == layer.weight.element_size()
        assert layer.weight.shape == (layer.out_features, layer.in_features) and torch.isnan(layer.weight).all()
    for _ in range(2):  # two RL steps, two optimizer steps each
        a, b = kept.step(), released.step()
        assert {k: v for k, v in a.items() if not k.startswith(TIMING)} == \
            {k: v for k, v in b.items() if not k.startswith(TIMING)}
        assert all(torch.equal(x, y) for x, y in zip(_fp8_bytes(kept.model), _fp8_bytes(released.model)))
    va, vb = _values(kept.model), _values(released.model)
    assert va.keys() == vb.keys() and all(torch.equal(va[k], vb[k]) for k in va)
    assert all(torch.isfinite(v.float()).all() for v in vb.values())
    for fp8 in (False, True):  # the export writes the values, not the placeholders
        ea, eb = dict(_export_tensors(kept.model, fp8)), dict(_export_tensors(released.model, fp8))
        assert ea.keys() == eb.keys()
        assert all(torch.equal(ea[k].view(torch.uint8) if ea[k].dtype == torch.float8_e4m3fn else ea[k],
                               eb[k].view(torch.uint8) if eb[k].dtype == torch.float8_e4m3fn else eb[k]) for k in ea)


def test_a_resumed_run_with_released_weights_is_bitwise(tmp_path):
    from jetrl.train.policy import resume_trainer, save_trainer_checkpoint

    straight = _jet()
    ref = [straight.step() for _ in range(2)]
    first = _jet()
    first.step()
    save_trainer_checkpoint(first, tmp_path, metrics_cursor=0)
    del first
    resumed = _jet()
    assert resume_trainer(resumed, tmp_path)["step"] == 1
    again = resumed.step()
    assert {k: v for k, v in ref[1].items() if not k.startswith(TIMING)} == \
        {k: v for k, v in again.items() if not k.startswith(TIMING)}
    va, vb = _values(straight.model), _values(resumed.model)
    assert all(torch.equal(va[k], vb[k]) for k in va)
    assert all(torch.equal(a, b) for a, b in zip(straight.optimizer.masters, resumed.optimizer.masters))


def test_loading_a_state_dict_writes_the_master():
    layer = FP8Linear(256, 128, bias=False, dtype=torch.bfloat16)
    master = layer.weight.detach().float().clone()
    master += torch.randn(master.shape, generator=torch.Generator().manual_seed(1)) * 1e-4  # fp32 bits below bf16's
    fine = master.clone()
    layer.release_weight(master)
    saved = layer.state_dict()["weight"]
    assert saved.dtype == torch.bfloat16 and torch.equal(saved, fine.to(torch.bfloat16))
    layer.load_state_dict({"weight": saved})  # the weight it already rounds to: the master keeps its fp32 bits
    assert torch.equal(master, fine)
    other = torch.randn(128, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    before = layer.quantized_weight().data.view(torch.uint8).clone()
    layer.load_state_dict({"weight": other})
    assert torch.equal(master, other.float()) and torch.equal(layer.weight_values(), other)
    assert not torch.equal(layer.quantized_weight().data.view(torch.uint8), before)  # re-quantized from it
    with pytest.raises(RuntimeError, match="size mismatch"):
        layer.load_state_dict({"weight": other[:, :128]})
    with pytest.raises(ValueError, match="dropped its BF16 weight"):  # a recipe swap would share the placeholder
        layer.to_linear()


def test_what_cannot_drop_its_weight():
    rollout_only = FP8Linear(128, 128, dtype=torch.bfloat16, fp8_train=False)
    with pytest.raises(ValueError, match="FP8 on both sides"):
        rollout_only.release_weight(rollout_only.weight.detach().float())
    layer = FP8Linear(128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 tensor"):
        layer.release_weight(layer.weight.detach().clone())  # a BF16 "master"
    for recipe, dtype in (("fp8-rollout", torch.bfloat16), ("jet", torch.float32)):
        trainer = make_trainer(recipe, dtype=dtype)  # BF16 training; fp32 weights are their own masters
        assert not any(layer.weight_released for layer in fp8_linears(trainer.model))
    from jetrl.quant import apply_recipe

    model = torch.nn.Sequential(FP8Linear(128, 128, dtype=torch.bfloat16))
    model[0].release_weight(model[0].weight.detach().float())
    for recipe in ("fp8-rollout", "bf16"):  # a side without FP8 would read the NaN placeholder
        with pytest.raises(ValueError, match="dropped its BF16 weight"):
            apply_recipe(model, recipe)
    assert model[0].fp8_train and model[0].fp8_rollout  # left as it was
    apply_recipe(model, "jet")
    assert torch.isfinite(model(torch.ones(2, 128, dtype=torch.bfloat16))).all()


def test_a_second_trainer_on_a_released_model_starts_from_its_values():
    """A model an earlier trainer released: the next trainer restores its weights before copying or optimizing them
    (its masters start from them, as from any BF16 weight); an optimizer built on the placeholders is refused."""
    from jetrl.train.optim import MasterWeightAdamW, restore_fp8_weights

    first = _jet()
    first.step()
    values = _values(first.model)
    with pytest.raises(ValueError, match="restore_fp8_weights"):
        MasterWeightAdamW(first.model.parameters())
    second = make_trainer("jet", dtype=torch.bfloat16)  # a fresh model, then the first one handed to a new trainer
    from jetrl.rl.trainer import Trainer

    again = Trainer(second.config, first.model, first.engine, second.prompts, second.reward_fn, second.decode)
    assert all(torch.equal(v, values[k]) for k, v in _values(again.model).items())
    assert all(layer.weight_released for layer in fp8_linears(again.model))
    for layer in fp8_linears(again.model):  # the new optimizer's masters, from the BF16 values
        assert any(m is layer._master for m in again.optimizer.masters)
    m = again.step()
    assert all(torch.isfinite(v.float()).all() for v in _values(again.model).values()) and m["actor/num_updates"] == 2
    assert restore_fp8_weights(again.model) == len(fp8_linears(again.model))
    assert all(torch.equal(layer.weight, layer.weight_values()) for layer in fp8_linears(again.model))
