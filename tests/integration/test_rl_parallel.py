"""The MoE-parallel trainer with real processes (gloo): FSDP2 + expert parallelism gives the step
one process gives, checkpoints resume and reshard, and the RL job runs and survives a lost rank.

Layouts on 4 ranks (trainer.parallel): dp_shard 2 x ep 2; ep 4 over 2 simulated nodes with the
hierarchical dispatcher; dp_shard 4 (FSDP only); and 2 plain replicas. The synthetic batches and
the 8-expert model are tests/parallelcheck.py's; the load-balancing loss is on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import parallelcheck as pc
from jobutil import TINY_MODEL, job_cmd, save_random_init, trained_steps
from slipstream.runtime import spawn_ranks

DP2_EP2 = ["trainer.num_processes=4", "trainer.parallel.dp_shard=2", "trainer.parallel.ep=2"]
EP4_2NODES = ["trainer.num_processes=4", "trainer.parallel.ep=4",
              "trainer.parallel.ranks_per_node=2", "trainer.ep_dispatcher=hierarchical"]  # fmt: skip
FSDP4 = ["trainer.num_processes=4", "trainer.parallel.dp_shard=4"]
REPLICAS2 = ["trainer.num_processes=2"]
TOL = 1e-5  # fp32, 3 steps of AdamW at lr 0.01
# Weights after those steps, a sharded layout against the one process: the one process runs the
# packed path (hand-written backwards of the norms, projections and experts), the sharded ones
# the unpacked path through autograd, and FSDP sums gradients over ranks in another order; Adam's
# first steps move an element whose gradient is near 0 by ~lr whatever its size, so rounding
# differences there grow. Measured max |diff|: 0.8-6.6e-6 at f59355b, up to 1.3e-5 (layer 0's
# o_proj, fsdp4 and dp2xep2) with the packed-path Functions; a wrong gradient moves weights by
# ~lr = 1e-2.
STATE_TOL = 3e-5


def _world(layout: list[str]) -> int:
    return int(next(o for o in layout if o.startswith("trainer.num_processes=")).split("=")[1])


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    init = tmp_path_factory.mktemp("parallel") / "init"
    pc.save_init(init)
    return str(init), pc.train(str(init), [])


@pytest.mark.parametrize(
    "layout", [DP2_EP2, EP4_2NODES, FSDP4, REPLICAS2], ids=["dp2xep2", "ep4-2nodes", "fsdp4", "dp2"]
)
def test_layouts_take_the_single_process_step(reference, layout: list[str]) -> None:
    init, ref = reference
    got = spawn_ranks("parallelcheck:train", _world(layout), {"init_dir": init, "overrides": layout},
                      timeout_s=120)[0]  # fmt: skip
    for want, have in zip(ref["metrics"], got["metrics"], strict=True):
        for key in ("pg_loss", "aux_loss", "loss", "grad_norm", "num_tokens"):
            assert have[key] == pytest.approx(want[key], abs=TOL), (key, want[key], have[key])
        assert want["aux_loss"] > 0  # the load-balancing loss is on
    assert _max_diff(ref["state"], got["state"]) < STATE_TOL


@pytest.mark.slow  # a one-process reference and a 4-rank spawn of its own: 81 s here
def test_glm4_moe_family_on_ep4_takes_the_single_process_step(tmp_path: Path) -> None:
    """A glm4_moe model (sigmoid routing with a random correction bias, shared experts, a dense
    layer, biases, partial rotary) on ep 4: the same steps as one process, the correction bias
    loaded on every rank (a sharded build reads buffers too) and never trained."""
    init = tmp_path / "glm"
    pc.save_init(init, pc.GLM_MODEL)
    ref = pc.train(str(init), pc.GLM_MODEL[len(pc.MODEL) :])
    got = spawn_ranks("parallelcheck:train", 4,
                      {"init_dir": str(init), "overrides": [*pc.GLM_MODEL[len(pc.MODEL):],
                                                             *EP4_2NODES]},
                      timeout_s=120)[0]  # fmt: skip
    for want, have in zip(ref["metrics"], got["metrics"], strict=True):
        for key in ("pg_loss", "loss", "grad_norm", "num_tokens"):
            assert have[key] == pytest.approx(want[key], abs=TOL), (key, want[key], have[key])
    assert _max_diff(ref["state"], got["state"]) < STATE_TOL
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    saved = pc.load_state(init)[bias]
    assert torch.equal(got["state"][bias], saved) and torch.equal(ref["state"][bias], saved)


def test_bf16_on_the_sharded_layout_is_the_one_process_bf16_step(reference) -> None:
    """trainer.precision = bf16 on FSDP2 (MixedPrecisionPolicy: bf16 parameters gathered,
    float32 gradient reduction) and on one process (autocast): the same 3 steps within bf16
    rounding, float32 master weights. Weights are compared by their update's direction: Adam
    moves an element whose gradient is near 0 by ~lr whichever sign rounding gives it, so the
    largest element difference says nothing (measured: cosine 0.986 bf16 sharded vs one
    process, 0.989 vs float32; float32 sharded vs one process 1.0000)."""
    init, ref32 = reference
    start = pc.train(init, [], num_steps=0)["state"]
    bf16 = ["trainer.precision=bf16"]
    one = pc.train(init, bf16)
    got = spawn_ranks("parallelcheck:train", 2, {"init_dir": init,
                      "overrides": ["trainer.num_processes=2", "trainer.parallel.dp_shard=2", *bf16]},
                      timeout_s=120)[0]  # fmt: skip
    assert {v.dtype for v in got["state"].values()} == {torch.float32}
    for want, have in zip(one["metrics"], got["metrics"], strict=True):
        for key in ("pg_loss", "loss", "grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=5e-2, abs=5e-3), (key, want, have)

    def update(state: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([(state[k] - start[k]).flatten() for k in sorted(state)])

    def cosine(a: dict, b: dict) -> float:
        return float(torch.nn.functional.cosine_similarity(update(a), update(b), 0))

    assert cosine(one["state"], got["state"]) > 0.95
    assert cosine(ref32["state"], got["state"]) > 0.95
    assert cosine(ref32["state"], got["state"]) < 0.9999  # bf16 did take effect


def test_sharded_checkpoint_resumes_exactly_and_reshards(reference, tmp_path: Path) -> None:
    """2 steps on dp2 x ep2, checkpoint (DCP, every rank's shards + manifest); resumed on the
    same layout the third step equals the uninterrupted run; resumed on ep 4 (resharded) it
    equals the single-process run."""
    init, ref = reference
    store = str(tmp_path / "store")
    kw = {"init_dir": init, "store_url": store}
    spawn_ranks("parallelcheck:train_and_save", 4, {**kw, "overrides": DP2_EP2, "num_steps": 2},
                timeout_s=120)  # fmt: skip
    manifest = json.loads((tmp_path / "store/ckpt/step_00000002/manifest.json").read_text())
    assert sum(name.endswith(".distcp") for name in manifest["sharded"]) == 4
    same = spawn_ranks("parallelcheck:resume_and_train", 4,
                       {**kw, "overrides": DP2_EP2, "step": 2, "num_steps": 3}, timeout_s=120)[0]  # fmt: skip
    uninterrupted = spawn_ranks("parallelcheck:train", 4, {"init_dir": init, "overrides": DP2_EP2},
                                timeout_s=120)[0]  # fmt: skip
    assert same["coordinator"] == {"saved_by": 4}
    assert same["metrics"][0]["loss"] == pytest.approx(
        uninterrupted["metrics"][2]["loss"], abs=1e-7
    )
    assert _max_diff(same["state"], uninterrupted["state"]) < 1e-6
    resharded = spawn_ranks("parallelcheck:resume_and_train", 4,
                            {**kw, "overrides": EP4_2NODES, "step": 2, "num_steps": 3},
                            timeout_s=120)[0]  # fmt: skip
    assert resharded["metrics"][0]["loss"] == pytest.approx(ref["metrics"][2]["loss"], abs=TOL)
    assert _max_diff(resharded["state"], ref["state"]) < STATE_TOL


def test_unsharded_checkpoint_is_refused_by_a_sharded_layout(reference, tmp_path: Path) -> None:
    init, _ = reference
    store = str(tmp_path / "store")
    pc.train_and_save(init, [], store, 1)  # one process: trainer.pt
    with pytest.raises(Exception, match="unsharded trainer"):
        spawn_ranks("parallelcheck:resume_and_train", 4,
                    {"init_dir": init, "overrides": DP2_EP2, "store_url": store, "step": 1,
                     "num_steps": 2}, timeout_s=60)  # fmt: skip


# ---- the RL job ------------------------------------------------------------------------------

JOB = [
    *TINY_MODEL, "trainer.num_processes=4", "trainer.parallel.ep=4", "trainer.groups_per_step=4",
    "rollout.group_size=4", "trainer.mode=sync", "trainer.skip_no_signal=false",
    "trainer.lr=0.01", "rollout.lease_ttl_s=5", "trainer.batch_timeout_s=60",
]  # fmt: skip


def _ranks_of(output_dir: Path) -> dict[int, int]:
    """rank -> pid of the job's follower trainer ranks (launch/dp.py processes)."""
    out = subprocess.run(["pgrep", "-af", "slipstream.launch.dp"], capture_output=True, text=True)
    spec = str(output_dir / "launch" / "logs" / "dp_spec.json")
    ranks = {}
    for line in out.stdout.splitlines():
        pid, *argv = line.split()
        if spec in argv:
            ranks[int(argv[argv.index("--rank") + 1])] = int(pid)
    return ranks


@pytest.mark.slow
def test_job_with_expert_parallel_ranks_survives_a_lost_rank(tmp_path: Path) -> None:
    """`slipstream run` with 4 trainer ranks as ep 4: a follower rank killed mid-run fails the
    job cleanly (exit != 0 well inside the group timeout, no trainer process left); started
    again, it resumes from its last checkpoint and finishes; the published weights load in
    transformers and give the job's own logits."""
    save_random_init(tmp_path / "init", TINY_MODEL)
    out = tmp_path / "run"
    cmd = job_cmd(tmp_path, out, [*JOB, "trainer.steps=40", "trainer.checkpoint_every=2"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=open(tmp_path / "job1.err", "wb"))  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while len(trained_steps(out / "metrics.jsonl")) < 5:
            assert job.poll() is None, (tmp_path / "job1.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "the job trained nothing"
            time.sleep(0.2)
        ranks = _ranks_of(out)
        assert sorted(ranks) == [1, 2, 3], ranks
        t_kill = time.monotonic()
        os.kill(ranks[2], signal.SIGKILL)
        code = job.wait(timeout=120)
        failed_after_s = time.monotonic() - t_kill
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert code != 0
    assert failed_after_s < 60  # the lost rank is seen at the next collective, not at a timeout
    err = (tmp_path / "job1.err").read_text()
    assert "slipstream: trainer rank 2 (exit -9" in err, err[-3000:]
    time.sleep(1.0)
    assert _ranks_of(out) == {}, "trainer ranks outlived the job"
    before = trained_steps(out / "metrics.jsonl")
    last_ckpt = max(int(p.name.split("_")[1]) for p in (out / "store" / "ckpt").glob("step_*")
                    if (p / "manifest.json").exists())  # fmt: skip
    assert 2 <= last_ckpt < 40
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=400)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    after = trained_steps(out / "metrics.jsonl")
    assert sorted(after) == list(range(1, 41)) and len(before) < 40
    assert f"**resumed from step**: {last_ckpt}" in (out / "report.md").read_text()

    export = tmp_path / "export"
    exp = subprocess.run([cmd[0], "ckpt", "export", f"--store.url={out / 'store'}", str(export)],
                         capture_output=True, text=True)  # fmt: skip
    assert exp.returncode == 0, exp.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    from slipstream.model import load_pretrained

    hf = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    ours = load_pretrained(export)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits_BTV, atol=1e-4, rtol=1e-4)
