"""The asynchronous RL loop: task queue with leases, rollout workers, staleness-bounded buffer,
GRPO/PPO trainer, weight publishing, checkpoint/resume. See docs/rl.md."""
