"""The RL algorithm of jetrl: advantages and losses as pure tensor functions (:mod:`~jetrl.rl.advantages`,
:mod:`~jetrl.rl.losses`, :mod:`~jetrl.rl.mismatch`), the trainer (:mod:`~jetrl.rl.trainer`) and the loop
(:mod:`~jetrl.rl.loop`). Importing the package loads none of them: the trainer and the loop import the models and
the rollout engine. Checkpoints and the optimizer live in the training stage below (:mod:`jetrl.train`), which SFT
shares.
"""
