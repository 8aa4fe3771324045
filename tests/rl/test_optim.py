"""Master-weight AdamW, LR schedules, gradient clipping and the non-finite step guard."""

import copy
import math

import pytest
import torch
import torch.nn as nn

import jetrl.train.optim as optim_mod
from jetrl.train.optim import (
    LRSchedule, MasterWeightAdamW, NonFiniteError, OptimizerStepper, build_lr_scheduler, clip_grad_norm,
)


def tiny_model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def set_grads(model, gen, scale=1.0):
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def test_masters_match_fp32_adamw_bitwise(gen):
    """bf16 params: the masters follow exactly the fp32 AdamW trajectory; params are their rounding."""
    model = tiny_model()
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = MasterWeightAdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([{"params": [r for r in ref if r.ndim >= 2], "weight_decay": 0.1},
                                 {"params": [r for r in ref if r.ndim < 2], "weight_decay": 0.0}],
                                lr=1e-4, foreach=False)
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(30):
        set_grads(model, gen)
        for p, r in zip(model.parameters(), ref):
            r.grad = p.grad.float()
        opt.gather_grads()
        opt.step()
        ref_opt.step()
    for p, m, r in zip(model.parameters(), opt.masters, ref):
        assert torch.equal(m, r)
        assert torch.equal(p, r.to(torch.bfloat16))
    # 30 steps of ~1e-4 move weights by ~3e-3: most bf16 weights change only through the master copy
    moved = sum(int((p != s).sum()) for p, s in zip(model.parameters(), start))
    assert moved > 0


def test_small_updates_are_not_lost():
    """A 1e-6 update rounds away in bf16 directly but accumulates in the fp32 master."""
    w = nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([w], lr=1e-3)  # Adam steps are ~lr: 1e-3 < bf16 half-ulp at 1.0 (2^-8)
    for _ in range(20):
        w.grad = torch.ones_like(w)
        opt.gather_grads()
        opt.step()
    assert torch.allclose(opt.masters[0], torch.full((4, 4), 1 - 20e-3), rtol=0, atol=1e-5)
    assert torch.equal(w, opt.masters[0].to(torch.bfloat16)) and not torch.equal(w, torch.ones_like(w))


def test_fp32_params_are_optimised_in_place():
    model = tiny_model(torch.float32)
    opt = MasterWeightAdamW(model.parameters())
    assert all(m is p for m, p in zip(opt.masters, model.parameters()))
    assert opt.state_dict()["masters"] == {}


def test_lr_schedules():
    s = LRSchedule(warmup_steps=4, total_steps=14, schedule="cosine", min_lr_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == pytest.approx(1.0)
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)
    lin = LRSchedule(0, 10, "linear")
    assert [lin(i) for i in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert LRSchedule(2, 10, "constant")(7) == 1.0
    with pytest.raises(ValueError, match="unknown LR schedule"):
        LRSchedule(0, 10, "step")


def test_clip_grad_norm(gen):
    grads = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
    clipped = [g.clone() for g in grads]
    assert clip_grad_norm(clipped, 0.5) == pytest.approx(norm, rel=1e-6)
    assert math.sqrt(sum(float((g ** 2).sum()) for g in clipped)) == pytest.approx(0.5, rel=1e-5)
    same = [g.clone() for g in grads]
    clip_grad_norm(same, 1e9)
    assert all(torch.equal(a, b) for a, b in zip(same, grads))
    assert math.isnan(clip_grad_norm([torch.tensor([1.0, float("nan")])], 1.0))


def make_stepper(model, max_skips=2, **kw):
    opt = MasterWeightAdamW(model.parameters(), lr=1e-3)
    sched = build_lr_scheduler(opt, warmup_steps=2, total_steps=10, schedule="linear")
    return OptimizerStepper(model, opt, sched, max_consecutive_nonfinite=max_skips, **kw)


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(gen, monkeypatch):
    refreshed = []
    monkeypatch.setattr(optim_mod, "refresh_fp8_weights", lambda m: refreshed.append(m))
    model = tiny_model()
    stepper = make_stepper(model, max_skips=2)
    set_grads(model, gen)
    r = stepper.step()
    assert r.applied and r.lr == pytest.approx(0.5e-3) and len(refreshed) == 1
    snapshot = copy.deepcopy((model.state_dict(), stepper.optimizer.state_dict(), stepper.scheduler.state_dict()))

    set_grads(model, gen)
    next(model.parameters()).grad[0, 0] = float("nan")
    r = stepper.step()
    assert not r.applied and math.isnan(r.grad_norm) and r.num_skipped == 1 and r.num_consecutive_skipped == 1
    assert all(p.grad is None for p in model.parameters())
    set_grads(model, gen)
    r = stepper.step(loss_is_finite=False)  # finite gradients, but the loss was not
    assert not r.applied and r.num_consecutive_skipped == 2
    # nothing moved: parameters, masters, moments, LR schedule
    after = (model.state_dict(), stepper.optimizer.state_dict(), stepper.scheduler.state_dict())
    for a, b in zip(torch.utils._pytree.tree_leaves(snapshot), torch.utils._pytree.tree_leaves(after)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert len(refreshed) == 1

    set_grads(model, gen)
    r = stepper.step()  # a good step resets the streak, the total stays
    assert r.applied and r.num_consecutive_skipped == 0 and r.num_skipped == 2 and r.lr == pytest.approx(1e-3)
    for _ in range(2):
        set_grads(model, gen, scale=float("inf"))
        assert not stepper.step().applied
    set_grads(model, gen, scale=float("inf"))
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row had a non-finite gradient norm.*"
                                             r"max_consecutive_nonfinite=2"):
        stepper.step()


def test_zero_tolerance_raises_at_once(gen):
    model = tiny_model()
    stepper = make_stepper(model, max_skips=0)
    set_grads(model, gen)
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        stepper.step(loss_is_finite=False)


def test_step_refreshes_fp8_weights(gen):
    from jetrl.quant import apply_recipe, fp8_linears
    model = apply_recipe(nn.Sequential(nn.Linear(128, 128)), "jet")
    layer = fp8_linears(model)[0]
    before = layer.quantized_weight()
    before_data, before_scale = before.data.view(torch.uint8).clone(), before.scale.clone()
    stepper = make_stepper(model)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    assert stepper.step().applied
    after = layer.quantized_weight()
    assert not torch.equal(before_data, after.data.view(torch.uint8)) or not torch.equal(before_scale, after.scale)
    from jetrl.quant.reference import quantize_tensor
    assert torch.equal(after.data.view(torch.uint8), quantize_tensor(layer.weight.detach(), (128, 128)).data.view(torch.uint8))


def test_state_dict_round_trip_continues_bitwise(gen):
    model_a = tiny_model()
    stepper_a = make_stepper(model_a)
    grads = [[torch.randn(p.shape, generator=gen).bfloat16() for p in model_a.parameters()] for _ in range(6)]

    def run(model, stepper, steps):
        for gs in steps:
            for p, g in zip(model.parameters(), gs):
                p.grad = g.clone()
            stepper.step()

    run(model_a, stepper_a, grads[:3])
    state = copy.deepcopy({"model": model_a.state_dict(), "opt": stepper_a.optimizer.state_dict(),
                           "sched": stepper_a.scheduler.state_dict(), "stepper": stepper_a.state_dict()})
    run(model_a, stepper_a, grads[3:])

    model_b = tiny_model(seed=1)
    stepper_b = make_stepper(model_b)
    model_b.load_state_dict(state["model"])
    stepper_b.optimizer.load_state_dict(state["opt"])
    stepper_b.scheduler.load_state_dict(state["sched"])
    stepper_b.load_state_dict(state["stepper"])
    run(model_b, stepper_b, grads[3:])
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(stepper_a.optimizer.masters, stepper_b.optimizer.masters):
        assert torch.equal(a, b)
    assert stepper_a.scheduler.get_last_lr() == stepper_b.scheduler.get_last_lr()


def test_bad_construction():
    with pytest.raises(ValueError, match="no trainable parameters"):
        MasterWeightAdamW([])
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="same parameter twice"):
        MasterWeightAdamW([lin.weight, lin.weight])


def test_the_stepper_and_schedule_reject_settings_that_would_train_wrong():
    """A clip of 0 zeroes every gradient and a negative one climbs the loss: errors, as a negative warm-up is."""
    import torch.nn as nn

    from jetrl.train.optim import LRSchedule, MasterWeightAdamW, OptimizerStepper

    model = nn.Linear(4, 4)
    for bad in (dict(grad_clip=0.0), dict(grad_clip=-1.0), dict(max_consecutive_nonfinite=-1)):
        with pytest.raises(ValueError, match="grad_clip > 0 or None"):
            OptimizerStepper(model, MasterWeightAdamW(model.parameters()), **bad)
    with pytest.raises(ValueError, match="warmup_steps >= 0"):
        LRSchedule(-1, 10)
