"""Supervised warm-start: the character tokenizer and causal-LM training (packed or padded) on a task's worked
solutions.

``jetrl sft`` trains the embedded default model from scratch with :func:`jetrl.sft.train.run_sft`.
"""

__all__ = ["SFTConfig", "run_sft"]


def __getattr__(name: str):
    # the trainer imports torch and the models package: load it on first use only
    if name in ("SFTConfig", "run_sft"):
        from jetrl.sft import train
        return getattr(train, name)
    raise AttributeError(f"module 'jetrl.sft' has no attribute {name!r}")
