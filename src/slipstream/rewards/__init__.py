"""Rewards: `[[reward.functions]]`, the one reward mechanism (docs/rewards.md).

- `rewardset.py`: `RewardSet`, the rollout worker's Verifier: the weighted sum of the task's
  verifier, a reward model (registered by rm/source.py, which can import rm), math-verify, exact
  and regex matches and users' Python functions (TRL's signature); per-sample components as each
  completion finishes, group components once its group finished; never a reward for a failure.
- `pool.py`: `RewardPool`, the worker processes user code runs in (wall-clock timeout, memory
  limit, kill and replace).
- `builtin.py`: the math / exact / regex kinds.
- `metrics.py`: per-step component metrics of a batch (the trainer logs them).

Layer: above `envs` (it raises envs' RewardDropped), below `rl` (rl/verifier.py and the worker use
it) and `rm` (which adds the reward-model kind). This package's `__init__` imports nothing: the
reward processes unpickle `pool._serve` through it and must not import the engine or torch.
"""
