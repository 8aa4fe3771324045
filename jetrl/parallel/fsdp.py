"""FSDP2 for the policy: shard per decoder block, and the full weights the rollout side needs.

**Training.** :func:`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to every decoder block
and then to the whole model (embedding, final norm and LM head form the root's group). Each parameter
becomes a DTensor sharded along dim 0 over the mesh's ``shard`` dimension; a block's forward all-gathers
its parameters just before it runs and frees them after (they are gathered again for backward), and its
gradients are reduce-scattered so that every rank keeps the gradient slice of its parameter slice. The
optimizer then works on those slices (fp32 master weights and moments sharded with them). Gradients are
*summed* over ranks (divide factor 1): the trainer normalises every rank's loss by the whole mini-batch's
token / sequence counts, so the sum is exactly the one-process gradient of the same global batch.

**FP8.** An :class:`jetrl.quant.FP8Linear` quantizes ``self.weight`` inside its forward, which under
FSDP2 is the all-gathered BF16 weight: the FP8 bytes and scales are bitwise those of one process (the
same tensor, the same quantizer). Quantizing after the gather costs the gather in BF16 (2 bytes per
parameter); its alternative, gathering each rank's locally quantized 128-row blocks, is not built yet.

**Rollout.** :func:`full_weights` gathers every parameter once and keeps it gathered while the engine
generates (no per-block gather at every decode step), then frees it; in the FP8 recipes the first use
of each ``FP8Linear`` quantizes the full weight into its cache, which is what the engine reads.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from jetrl.parallel.mesh import ParallelContext
from jetrl.quant import refresh_fp8_weights

# the model's forward methods besides ``forward`` (the trainer's and the engine's), registered with FSDP so that the
# root gathers its parameters for them
FORWARD_METHODS = ("forward_packed", "forward_paged")


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2-wrapped modules inside ``model`` (the root last), empty when it is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if mods and mods[0] is model:
        mods = mods[1:] + [model]
    return mods


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped by :func:`shard_model`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, parallel: ParallelContext) -> nn.Module:
    """Apply FSDP2 to ``model`` in place over ``parallel.mesh``: each decoder block, then the root.

    Parameters keep their dtype (BF16 stays BF16, the fp32 master copies live in the optimizer).
    Returns ``model`` (the same object; its class becomes an FSDP subclass). One rank: unchanged."""
    if parallel.mesh is None:
        return model
    if is_sharded(model):
        raise ValueError("the model is already sharded")
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for block in model.model.layers:  # a jetrl decoder's blocks
        fully_shard(block, mesh=parallel.mesh, reshard_after_forward=True)
    # the root's parameters (embedding, LM head) are used right after the blocks: keep them for backward
    fully_shard(model, mesh=parallel.mesh, reshard_after_forward=False)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(model, name)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)  # sum, not mean: the losses carry the global normalisers
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM collective (gloo has no pre-scaled sum)
    return model


@contextlib.contextmanager
def full_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block every parameter of a sharded ``model`` is whole (gathered once); the blocks
    do not free them after each forward. Used around rollout (see the module doc). A no-op when the model
    is not sharded."""
    mods = fsdp_modules(model)  # none when the model is not sharded
    blocks = mods[:-1]
    try:
        for m in mods:
            m.unshard()
        for m in blocks:
            m.set_reshard_after_forward(False, recurse=False)
        yield model
    finally:
        for m in blocks:
            m.set_reshard_after_forward(True, recurse=False)
        for m in mods:
            m.reshard()


def refresh_rollout_weights(model: nn.Module) -> int:
    """After an update: drop every cached FP8 weight and, when the weights are whole on this rank,
    re-quantize them now (a sharded model re-quantizes inside the next :func:`full_weights`, the only
    place its full weights exist). Returns the number of FP8 layers."""
    return refresh_fp8_weights(model, eager=not is_sharded(model))


__all__ = ["shard_model", "full_weights", "fsdp_modules", "is_sharded", "refresh_rollout_weights", "FORWARD_METHODS"]
