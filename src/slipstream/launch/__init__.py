"""Launchers: place the trainer and rollout workers (local processes; Ray is not implemented)."""
