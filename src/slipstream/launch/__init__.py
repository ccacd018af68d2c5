"""Placing a job's processes. Layered, each module importing only those below it:

job.py        the job driver of `slipstream run` (start checkpoint, run, report)
base.py       the `Launcher` protocol and its factory (run.launcher)
local.py      rollout workers as local processes (the embedded default)
ray.py        rollout workers as Ray actors (the `ray` extra)
scheduled.py  roles a scheduler placed (run.launcher = "torchx"): torchrun trainer ranks, workers
              that connect to rank 0's coordinator
torchx.py     the TorchX component `rl` that describes those roles (the `torchx` extra)
dp.py         data-parallel trainer ranks on this machine
supervise.py  one supervision policy for every launcher (restarts, crash loops, drains)
worker.py     rollout worker assembly (engine, verifier, store) and its process entry point
"""
