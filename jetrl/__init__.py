"""jetrl: reinforcement learning of LLMs with a unified FP8 precision flow.

Rollout and training run the same blockwise FP8 quantization of every linear layer, so the policy
learns from data produced by exactly the policy being trained. Stages, in data-flow order:
``quant`` (numerics) <- ``models`` <- ``rollout`` <- ``rl``, with ``data`` feeding ``rl``.
"""

__version__ = "0.1.0"
