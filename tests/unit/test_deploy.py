"""Contract checks of deploy/ (Dockerfile, eksctl cluster, EFA plugin, KubeRay RayJob). None of it
can be applied here (no Docker daemon, no cluster, no AWS), so these tests check what can go
wrong silently: the RayJob's entrypoint is a `slipstream run` this CLI accepts, the pods land on
the node groups the cluster defines, shared paths and ports agree, and the image pins agree
with the rest of the repo."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from slipstream.cli import build_parser, split_overrides
from slipstream.config import SlipstreamConfig, load_config

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(rel: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / rel).read_text()) if d is not None]


def rayjob() -> dict[str, Any]:
    return next(d for d in load("kuberay/rayjob.yaml") if d["kind"] == "RayJob")


def node_groups() -> dict[str, dict[str, Any]]:
    (cluster,) = load("eks/cluster.yaml")
    return {g["name"]: g for g in cluster["managedNodeGroups"]}


def job_config() -> tuple[SlipstreamConfig, list[str]]:
    argv = shlex.split(rayjob()["spec"]["entrypoint"])
    assert argv[:2] == ["slipstream", "run"], argv
    rest, overrides = split_overrides(argv[1:])
    args = build_parser().parse_args(rest)
    return load_config(args.config, overrides), overrides


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def mount_of(c: dict[str, Any], path: str) -> str:
    """The volume a container mounts at a prefix of `path`."""
    hits = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert hits, f"{c['name']} mounts nothing above {path}"
    return hits[0]["name"]


def test_manifests_parse_and_name_their_kinds() -> None:
    assert [d["kind"] for d in load("kuberay/rayjob.yaml")] == ["RayJob", "PersistentVolumeClaim"]
    assert [d["kind"] for d in load("eks/cluster.yaml")] == ["ClusterConfig"]
    assert [d["kind"] for d in load("eks/efa-device-plugin.yaml")] == ["DaemonSet"]
    assert rayjob()["apiVersion"] == "ray.io/v1"


def test_entrypoint_is_a_valid_ray_job_with_http_rollouts() -> None:
    cfg, _ = job_config()
    spec = rayjob()["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]
    (rollout,) = spec["workerGroupSpecs"]
    assert cfg.run.launcher == "ray" and cfg.run.ray_address == "auto"
    assert cfg.store.url and cfg.store.url.startswith("s3://")  # every node reads the store
    # rollout actors (num_cpus=1 each) fit the worker pods' CPU slots; none lands on the head
    assert head["rayStartParams"]["num-cpus"] == "0"
    slots = rollout["replicas"] * int(rollout["rayStartParams"]["num-cpus"])
    assert cfg.rollout.num_workers == slots
    # one data-parallel rank per head GPU
    head_c = container(head["template"], "ray-head")
    assert cfg.trainer.num_processes == head_c["resources"]["limits"]["nvidia.com/gpu"]
    assert cfg.trainer.groups_per_step % cfg.trainer.num_processes == 0
    # the server beside each actor: same port, and the stage dir on a volume both containers share
    pod = rollout["template"]
    worker_c, sglang = container(pod, "ray-worker"), container(pod, "sglang")
    assert cfg.engine.type == "http" and cfg.engine.url == "http://127.0.0.1:30000"
    assert "--port=30000" in sglang["command"] and "--host=127.0.0.1" in sglang["command"]
    assert cfg.engine.weights_stage_dir is not None
    stage = cfg.engine.weights_stage_dir
    assert mount_of(worker_c, stage) == mount_of(sglang, stage)
    # starting weights: the trainer's init_from and the server's model path are filled by the
    # init containers, on the volumes the main containers mount
    assert cfg.model.init_from is not None
    for pod_t, main, path in ((head["template"], head_c, cfg.model.init_from),
                              (pod, sglang, _flag(sglang["command"], "--model-path"))):  # fmt: skip
        (init,) = pod_t["spec"]["initContainers"]
        assert init["command"][-1] == path, init["command"]
        assert mount_of(init, path) == mount_of(main, path)
    assert (
        cfg.run.output_dir.startswith("/runs/") and mount_of(head_c, cfg.run.output_dir) == "runs"
    )


def test_spot_eviction_drains_the_rollout_actor_within_the_grace_period() -> None:
    cfg, _ = job_config()
    (rollout,) = rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    pod = rollout["template"]
    hook = " ".join(container(pod, "ray-worker")["lifecycle"]["preStop"]["exec"]["command"])
    assert cfg.rollout.drain_file and f"touch {cfg.rollout.drain_file}" in hook
    wait_s = float(re.search(r"sleep (\d+)", hook).group(1))
    # the actor sees the file within 0.5 s and drains within drain_timeout_s; the hook waits for
    # that, and Kubernetes waits for the hook
    assert cfg.rollout.drain_timeout_s + 1 <= wait_s < pod["spec"]["terminationGracePeriodSeconds"]
    # the server beside it gets SIGTERM after its own preStop: it must outlast the drain
    server_hook = container(pod, "sglang")["lifecycle"]["preStop"]["exec"]["command"]
    assert server_hook[0] == "sleep" and float(server_hook[1]) >= wait_s


def _flag(command: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in command if a.startswith(name + "="))


def test_pods_land_on_the_node_groups_the_cluster_defines() -> None:
    groups = node_groups()
    spec = rayjob()["spec"]["rayClusterSpec"]
    (rollout,) = spec["workerGroupSpecs"]
    for pod, group in ((spec["headGroupSpec"]["template"], "trainer"),
                       (rollout["template"], "rollout")):  # fmt: skip
        g = groups[group]
        selector = pod["spec"]["nodeSelector"]
        assert all(g["labels"].get(k) == v for k, v in selector.items()), (group, selector)
        tolerated = {(t["key"], t["effect"]) for t in pod["spec"]["tolerations"]}
        assert {(t["key"], t["effect"]) for t in g.get("taints", [])} <= tolerated
    trainer, rollout_ng = groups["trainer"], groups["rollout"]
    assert trainer["efaEnabled"] is True and len(trainer["availabilityZones"]) == 1
    assert rollout_ng["spot"] is True and "spot" not in trainer
    assert rollout_ng["availabilityZones"] == trainer["availabilityZones"]
    # the EFA plugin runs where the trainer asks for EFA interfaces
    (plugin,) = load("eks/efa-device-plugin.yaml")
    assert plugin["spec"]["template"]["spec"]["nodeSelector"] == {
        "eks.amazonaws.com/nodegroup": "trainer"
    }
    head_c = container(spec["headGroupSpec"]["template"], "ray-head")
    assert head_c["resources"]["limits"]["vpc.amazonaws.com/efa"] > 0
    # pods run as the service account that IRSA gives S3 access
    (cluster,) = load("eks/cluster.yaml")
    accounts = {a["metadata"]["name"] for a in cluster["iam"]["serviceAccounts"]}
    for pod in (spec["headGroupSpec"]["template"], rollout["template"]):
        assert pod["spec"]["serviceAccountName"] in accounts


def test_image_pins_agree_with_the_repo() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=\"?([^\"\n]*)\"?$", dockerfile, re.M))
    setup = (DEPLOY.parent / "scripts" / "setup.sh").read_text()
    assert f'pip install -q "{args["TORCH_SPEC"]}"' in setup  # same torch as the dev setup
    assert args["RAY_VERSION"] == rayjob()["spec"]["rayClusterSpec"]["rayVersion"]
    assert '".[serve,s3]"' in dockerfile  # the entrypoint's store is s3://
    assert "-c /tmp/torch-pin.txt" in dockerfile  # the extras do not swap the torch build
    spec = rayjob()["spec"]["rayClusterSpec"]
    (rollout,) = spec["workerGroupSpecs"]
    head_image = container(spec["headGroupSpec"]["template"], "ray-head")["image"]
    assert container(rollout["template"], "ray-worker")["image"] == head_image
