"""Precision recipes: the layer swap, the two sides, and the backend seam."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from jetrl.quant import FP8Linear, PrecisionRecipe, apply_recipe, get_backend, get_recipe, precision_side, use_backend
from jetrl.quant import current_side, refresh_fp8_weights, set_backend


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 128)
        self.block = nn.ModuleDict({"q_proj": nn.Linear(128, 128), "up_proj": nn.Linear(128, 256)})
        self.down_proj = nn.Linear(256, 128)
        self.lm_head = nn.Linear(128, 50, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        h = self.block["q_proj"](h)
        h = self.down_proj(F.silu(self.block["up_proj"](h)))
        return self.lm_head(h)


def test_apply_recipe_swaps_shares_and_reverts():
    model = TinyLM()
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    apply_recipe(model, "jet")
    assert isinstance(model.block["q_proj"], FP8Linear) and isinstance(model.down_proj, FP8Linear)
    assert type(model.lm_head) is nn.Linear, "the LM head stays out of FP8 by default"
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters()), "parameters must be shared, not copied"
    apply_recipe(model, "bf16")
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.precision_recipe.name == "bf16"


def test_custom_exclusion_patterns():
    model = apply_recipe(TinyLM(), get_recipe("jet", exclude=("down_proj",)))
    assert type(model.down_proj) is nn.Linear and isinstance(model.lm_head, FP8Linear)


def test_sides_select_precision(gen):
    ids = torch.randint(0, 50, (2, 9), generator=gen)
    model = TinyLM()
    with torch.no_grad():
        plain = model(ids)
        apply_recipe(model, "fp8-rollout")
        assert current_side() == "train"
        assert torch.equal(model(ids), plain), "fp8-rollout trains in BF16: training side is the plain layer"
        with precision_side("rollout"):
            assert current_side() == "rollout"
            rollout = model(ids)
        assert not torch.equal(rollout, plain)
        apply_recipe(model, "jet")
        train = model(ids)
        with precision_side("rollout"):
            assert torch.equal(model(ids), train), "jet: rollout and training compute bit-identical outputs"
        assert torch.equal(train, rollout), "the same FP8 quantization in fp8-rollout's rollout and in jet"
        # no-grad forwards of the trainer stay on the training side: the side never follows grad mode
        apply_recipe(model, "fp8-rollout")
        assert torch.equal(model(ids), plain)


def test_refresh_after_hidden_update(gen):
    model = apply_recipe(TinyLM(), "jet")
    ids = torch.randint(0, 50, (1, 5), generator=gen)
    with torch.no_grad():
        before = model(ids)
        for layer in model.modules():
            if isinstance(layer, FP8Linear):
                layer.weight.data.mul_(2)  # invisible to the version counter
        assert torch.equal(model(ids), before)
        assert refresh_fp8_weights(model, eager=True) == 3
        assert not torch.equal(model(ids), before)


def test_recipe_errors():
    with pytest.raises(ValueError, match="unknown precision recipe"):
        get_recipe("fp4")
    with pytest.raises(ValueError, match="must also roll out in FP8"):
        PrecisionRecipe("odd", rollout_fp8=False, train_fp8=True)
    with pytest.raises(ValueError, match="precision side"):
        with precision_side("eval"):
            pass
    with pytest.raises(TypeError, match="bare nn.Linear"):
        apply_recipe(nn.Linear(4, 4), "jet")


def test_backend_seam(monkeypatch):
    assert get_backend("cpu").name == "reference"
    with use_backend("reference"):
        assert get_backend("cpu").name == "reference"
    with pytest.raises(ValueError, match="unknown FP8 backend"):
        set_backend("fp4-magic")
    # 'cuda' chosen through the documented environment variable (``use_backend("cuda")`` would import the
    # Triton kernels first); ``use_backend("auto")`` clears any forced choice so that the variable is read
    monkeypatch.setenv("JETRL_FP8_BACKEND", "cuda")
    with use_backend("auto"):
        with pytest.raises(ValueError, match="tensors are on cpu"):
            get_backend("cpu")


def test_kv_fp8_sides_follow_the_recipe():
    """The FP8 KV cache's one rule: the training forward quantizes K/V under jet only; bf16 refuses the cache."""
    from jetrl.quant.recipe import kv_fp8_train

    assert kv_fp8_train("jet", True) and not kv_fp8_train("fp8-rollout", True)
    assert not any(kv_fp8_train(r, False) for r in ("bf16", "fp8-rollout", "jet"))
    assert kv_fp8_train(get_recipe("jet", pow2_scale=True), True)
    with pytest.raises(ValueError, match="recipe 'bf16' rolls out in BF16.*'fp8-rollout', 'jet'"):
        kv_fp8_train("bf16", True)


def test_fp8_weight_bytes_counts_the_copies_each_layer_holds():
    """What an FP8 recipe holds beyond the parameters: one E4M3 byte per weight plus its 128x128 scales, twice where
    W^T is cached (its scales are a view of W's on the reference backend: counted once)."""
    from jetrl.quant import FP8Linear, fp8_weight_bytes
    from jetrl.quant.kernels import tuning

    model = torch.nn.Sequential(FP8Linear(256, 384, bias=False), FP8Linear(384, 256, bias=False))
    assert fp8_weight_bytes(model) == 0
    x = torch.randn(5, 256)
    with torch.no_grad():
        model(x)
    data, scales = 2 * 384 * 256, 2 * (3 * 2) * 4
    assert fp8_weight_bytes(model) == data + scales
    with tuning.override(cache_weight_t=True):
        model(x.requires_grad_()).sum().backward()
    assert fp8_weight_bytes(model) == 2 * data + scales
