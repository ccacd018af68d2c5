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
    assert [d["kind"] for d in load("kuberay/rayjob-moe.yaml")] == ["RayJob"]
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


# ---- the GPU image (deploy/Dockerfile.gpu): the seed's pins, agreed across files -------------

GPU_PINS = ("SGLANG_DLC_TAG", "SGLANG_VERSION", "PYTORCH_VERSION", "PYTORCH_INDEX",
            "EFA_INSTALLER_VERSION", "NCCL_VERSION", "NVSHMEM_VERSION", "DEEPEP_VERSION",
            "DEEPEP_COMMIT", "DEEPGEMM_COMMIT", "RAY_VERSION")  # fmt: skip


def gpu_dockerfile() -> tuple[str, dict[str, str]]:
    text = (DEPLOY / "Dockerfile.gpu").read_text()
    return text, dict(re.findall(r"^ARG (\w+)=\"?([^\"\n]*)\"?$", text, re.M))


def test_gpu_image_pins_agree_with_docs_rayjob_and_code() -> None:
    from slipstream.moe.deepep import PINNED_COMMIT

    text, args = gpu_dockerfile()
    assert set(GPU_PINS) <= set(args), sorted(set(GPU_PINS) - set(args))
    # the seed's matrix: CUDA 13.0 everywhere, SGLang's version is its DLC's
    assert args["SGLANG_DLC_TAG"].startswith(args["SGLANG_VERSION"] + "-gpu-py312-cu130")
    assert args["PYTORCH_INDEX"].endswith("/cu130")
    assert args["DEEPEP_COMMIT"] == PINNED_COMMIT  # what moe/deepep.py was written against
    # docs/gpu.md's pin table
    docs = (DEPLOY.parent / "docs" / "gpu.md").read_text()
    table = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|$", docs, re.M))
    assert {k: table.get(k) for k in GPU_PINS} == {k: args[k] for k in GPU_PINS}
    assert "docker build -f deploy/Dockerfile.gpu -t $REGISTRY/slipstream:0.1.0-gpu ." in docs
    # the RayJob: its pin annotation, its images, its Ray version
    job = rayjob()
    pins = dict(p.split("=", 1) for p in
                job["metadata"]["annotations"]["slipstream.io/gpu-image-pins"].split())  # fmt: skip
    assert pins == {
        "pytorch": args["PYTORCH_VERSION"], "cuda": args["PYTORCH_INDEX"].rsplit("/", 1)[1],
        "efa-installer": args["EFA_INSTALLER_VERSION"], "nccl": args["NCCL_VERSION"],
        "nvshmem": args["NVSHMEM_VERSION"],
        "deepep": f"{args['DEEPEP_VERSION']}@{args['DEEPEP_COMMIT']}",
        "deepgemm": args["DEEPGEMM_COMMIT"], "sglang-dlc": args["SGLANG_DLC_TAG"],
    }  # fmt: skip
    spec = job["spec"]["rayClusterSpec"]
    (rollout,) = spec["workerGroupSpecs"]
    assert container(spec["headGroupSpec"]["template"], "ray-head")["image"].endswith(
        "/slipstream:0.1.0-gpu"
    )
    dlc = f"763104351884.dkr.ecr.{args['AWS_REGION']}.amazonaws.com/sglang:{args['SGLANG_DLC_TAG']}"
    assert container(rollout["template"], "sglang")["image"] == dlc
    assert args["RAY_VERSION"] == spec["rayVersion"]
    # every SGLang DLC reference under deploy/ and in docs/gpu.md is the pinned tag
    for path in [*DEPLOY.rglob("*"), DEPLOY.parent / "docs" / "gpu.md"]:
        if path.is_file():
            for tag in re.findall(r"amazonaws\.com/sglang:([\w.${}-]+)", path.read_text()):
                assert tag in (args["SGLANG_DLC_TAG"], "${SGLANG_DLC_TAG}"), (path, tag)


def test_gpu_image_installs_in_the_seeds_order_and_asserts_the_result() -> None:
    text, _ = gpu_dockerfile()
    runs = [r for r in re.split(r"^(?=RUN |COPY |ENV |WORKDIR )", text, flags=re.M)]
    pip_runs = [i for i, r in enumerate(runs) if "pip install" in r]
    nccl = [i for i, r in enumerate(runs) if "nvidia-nccl-cu13==${NCCL_VERSION}" in r]
    deepep = next(i for i, r in enumerate(runs) if "DeepEP.git" in r)
    # NCCL pinned before DeepEP compiles against it, and re-asserted after every other install
    assert nccl[0] < deepep and nccl[-1] == pip_runs[-1] and len(nccl) == 2
    assert "--force-reinstall --no-deps" in runs[nccl[-1]]
    # the seed's post-install assertions, after the last install
    checks = runs[pip_runs[-1] + 1]
    for line in ('grep -Fx "# EFA installer version: ${EFA_INSTALLER_VERSION}" '
                 "/opt/amazon/efa_installed_packages",
                 "test -f /opt/amazon/efa/lib/libfabric.so.1",
                 "test -f /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so"):  # fmt: skip
        assert line in checks, line
    for pin in ("${NCCL_VERSION}", "${NVSHMEM_VERSION}", "${SGLANG_VERSION}", "${PYTORCH_VERSION}",
                "${DEEPEP_VERSION}", "${DEEPEP_COMMIT}"):  # fmt: skip
        assert pin in checks, f"{pin} not asserted after the install"
    assert "--skip-kmod --no-verify --build-ngc --skip-mpi" in text
    assert '-c /tmp/torch-pin.txt ".[serve,s3]"' in text  # the extras keep the torch build
    assert "Never built".lower() in text.lower()
    ignore = (DEPLOY / "Dockerfile.gpu.dockerignore").read_text().split()
    assert {".git", ".venv", ".wheelhouse"} <= set(ignore)


def moe_rayjob() -> dict[str, Any]:
    return next(d for d in load("kuberay/rayjob-moe.yaml") if d["kind"] == "RayJob")


def _ray_resources(params: dict[str, str]) -> dict[str, float]:
    """KubeRay's `resources` rayStartParam: a JSON object inside a quoted string."""
    import json

    return json.loads(json.loads(params["resources"])) if "resources" in params else {}


def test_moe_rayjob_places_every_trainer_rank_on_a_trainer_gpu() -> None:
    """The multi-node trainer variant: the entrypoint is a valid sharded layout; the placement
    group's bundles (run.ray_trainer_resources) fit the slots the trainer pods advertise, with
    exactly ranks_per_node ranks per node (the driver's rank 0 included), on EFA trainer nodes."""
    job = moe_rayjob()
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["slipstream", "run"], argv
    rest, overrides = split_overrides(argv[1:])
    cfg = load_config(build_parser().parse_args(rest).config, overrides)
    tc, par = cfg.trainer, cfg.trainer.parallel
    assert cfg.run.launcher == "ray" and cfg.store.url.startswith("s3://")
    assert par.sharded and par.ep > 1 and par.dp_shard * par.ep == tc.num_processes
    assert cfg.model.num_experts % par.ep == 0 and tc.groups_per_step % tc.num_processes == 0
    spec = job["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    trainer = groups["trainer"]
    bundle = cfg.run.ray_trainer_resources
    assert bundle == {"GPU": 1.0, "slipstream_trainer": 1.0}
    head_gpus = int(head["rayStartParams"]["num-gpus"])
    head_slots = _ray_resources(head["rayStartParams"])["slipstream_trainer"]
    pod_gpus = int(trainer["rayStartParams"]["num-gpus"])
    pod_slots = _ray_resources(trainer["rayStartParams"])["slipstream_trainer"]
    # rank 0 (the driver) takes the head GPU that no rank actor gets
    assert head_slots == head_gpus - 1 and pod_slots == pod_gpus
    assert par.ranks_per_node == head_gpus == pod_gpus
    assert 1 + head_slots + trainer["replicas"] * pod_slots == tc.num_processes
    assert trainer["minReplicas"] == trainer["maxReplicas"] == trainer["replicas"]
    # the GPUs Ray advertises are the ones the pods hold; trainer pods sit on the EFA node group
    for pod, name, gpus in ((head["template"], "ray-head", head_gpus),
                            (trainer["template"], "ray-worker", pod_gpus)):  # fmt: skip
        limits = container(pod, name)["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == gpus and limits["vpc.amazonaws.com/efa"] > 0
        assert pod["spec"]["nodeSelector"] == {"slipstream.io/role": "trainer"}
        init = pod["spec"]["initContainers"][0]
        assert init["command"][-1] == cfg.model.init_from  # every rank reads its shard there
    groups_ng = node_groups()
    assert groups_ng["trainer"]["efaEnabled"] is True
    # the rollout side is rayjob.yaml's, unchanged
    assert groups["rollout"] == rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert cfg.rollout.num_workers == groups["rollout"]["replicas"]


# ---- the sandbox host agent (deploy/eks/sandbox-agent.yaml) and its socket in the rollout pods --

# vCPUs of the instance types a node group may launch (AWS's published figures)
INSTANCE_VCPUS = {"p5.48xlarge": 192, "p5e.48xlarge": 192, "p5en.48xlarge": 192}


def sandbox_agent() -> dict[str, Any]:
    (ds,) = load("eks/sandbox-agent.yaml")
    return ds


def agent_serve_config() -> tuple[Any, Any]:
    """The DaemonSet's command parsed by this CLI: (argparse namespace, loaded config)."""
    (c,) = sandbox_agent()["spec"]["template"]["spec"]["containers"]
    assert c["command"][:3] == ["slipstream", "sandbox", "serve"], c["command"]
    rest, overrides = split_overrides(c["command"][1:])
    args = build_parser().parse_args(rest)
    return args, load_config(args.config, overrides)


def host_path(pod: dict[str, Any], c: dict[str, Any], path: str) -> str:
    """Where `path` inside container `c` lives on the node (through a hostPath volume)."""
    mounts = [m for m in c["volumeMounts"]
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]  # fmt: skip
    assert mounts, f"{c['name']} mounts nothing above {path}"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == m["name"]]
    assert "hostPath" in vol, f"{path} of {c['name']} is on {vol}, not on the node"
    return vol["hostPath"]["path"].rstrip("/") + path[len(m["mountPath"].rstrip("/")) :]


def test_sandbox_agent_is_a_valid_serve_on_every_node_running_rollout_pods() -> None:
    ds = sandbox_agent()
    assert ds["kind"] == "DaemonSet" and ds["apiVersion"] == "apps/v1"
    pod = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    args, cfg = agent_serve_config()
    assert args.func.__name__ == "cmd_serve" and cfg.sandbox.backend == "bwrap"
    (c,) = pod["spec"]["containers"]
    assert c["securityContext"]["privileged"] is True  # namespaces, setuid, cgroups
    # the rollout pods' node group carries the agent's label, and the agent tolerates its taints
    groups = node_groups()
    (rollout,) = rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    selector = rollout["template"]["spec"]["nodeSelector"]
    hosts = [g for g in groups.values() if selector.items() <= g["labels"].items()]
    assert hosts and all(pod["spec"]["nodeSelector"].items() <= g["labels"].items() for g in hosts)
    tolerated = {(t["key"], t["effect"]) for t in pod["spec"]["tolerations"]}
    for g in hosts:
        assert {(t["key"], t["effect"]) for t in g.get("taints", [])} <= tolerated
    # one release: the agent protocol version of the rollout pods' image
    assert c["image"] == container(rollout["template"], "ray-worker")["image"]
    # the journal survives a restart (on the node), so the next agent reaps what this one left
    assert host_path(pod, c, cfg.sandbox.state_dir).startswith("/var/lib/")
    # probes are `slipstream sandbox status` of the socket it serves
    for probe in ("readinessProbe", "livenessProbe"):
        argv = c[probe]["exec"]["command"]
        st = build_parser().parse_args(argv[1:])
        assert st.func.__name__ == "cmd_status" and st.url == f"unix://{args.socket}"
    # SIGTERM drains: connected actors are served for drain_timeout_s, within the grace period,
    # and at least as long as a Spot-draining rollout actor may still need sandboxes
    job_cfg, _ = job_config()
    assert job_cfg.rollout.drain_timeout_s <= args.drain_timeout_s
    assert args.drain_timeout_s + 5 <= pod["spec"]["terminationGracePeriodSeconds"]


def test_rollout_pods_reach_the_agents_socket_through_the_same_node_directory() -> None:
    from slipstream.sandbox.host_protocol import parse_agent_url

    ds_pod = sandbox_agent()["spec"]["template"]
    (agent_c,) = ds_pod["spec"]["containers"]
    args, _ = agent_serve_config()
    on_node = host_path(ds_pod, agent_c, args.socket)
    for job in (rayjob(), moe_rayjob()):
        argv = shlex.split(job["spec"]["entrypoint"])
        rest, overrides = split_overrides(argv[1:])
        cfg = load_config(build_parser().parse_args(rest).config, overrides)
        groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
        pod = groups["rollout"]["template"]
        worker_c = container(pod, "ray-worker")
        path = parse_agent_url(cfg.rollout.sandbox_agent)
        assert host_path(pod, worker_c, path) == on_node
        # the directory is mounted (a file mount would keep a restarted agent's old socket),
        # read-only (no pod can unlink the socket or plant its own)
        (mount,) = [m for m in worker_c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True
        (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        assert vol["hostPath"]["type"] in ("Directory", "DirectoryOrCreate")
        assert not worker_c.get("securityContext", {}).get("runAsUser")  # root: socket 0660


def test_the_agent_serves_the_jobs_sandbox_template_within_its_pod_resources() -> None:
    from slipstream.sandbox.base import SandboxTemplate
    from slipstream.sandbox.host_protocol import template_mismatch

    args, cfg = agent_serve_config()
    job_cfg, _ = job_config()
    # the agent refuses a client whose template differs (hello): they must agree here
    agent_t = SandboxTemplate.from_config(cfg.sandbox)
    job_t = SandboxTemplate.from_config(job_cfg.sandbox)
    assert template_mismatch(agent_t, job_t) == []
    # admission capacity on the largest node it lands on fits what the pod reserves: CPUs
    # requested (no CPU limit: a CFS quota would throttle every sandbox at once) and a memory
    # limit covering every admitted sandbox's memory_mib (their cgroups nest under the pod's)
    (c,) = sandbox_agent()["spec"]["template"]["spec"]["containers"]
    hosts = [g for g in node_groups().values() if g["labels"].get("slipstream.io/sandbox-host")]
    types = [t for g in hosts for t in g.get("instanceTypes", [g.get("instanceType")])]
    vcpus = max(INSTANCE_VCPUS[t] for t in types)
    capacity = int(vcpus * cfg.sandbox.max_density + 1e-9) // agent_t.vcpus
    assert 0 < capacity * agent_t.vcpus <= float(c["resources"]["requests"]["cpu"])
    assert "cpu" not in c["resources"].get("limits", {})
    need_mib = capacity * agent_t.memory_mib + cfg.sandbox.memory_reserve_mib
    limit = c["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) * 1024 >= need_mib, (limit, need_mib)
    assert cfg.sandbox.min_idle <= capacity  # the warm pool fits in the admission limit


# ---- KEDA autoscaling of the Spot rollout capacity (deploy/keda/) -----------------------------


def keda(rel: str) -> dict[str, Any]:
    (doc,) = load(f"keda/{rel}")
    return doc


def _json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The RFC 6902 add / replace ops kustomize applies (replace needs the path to exist)."""
    import copy

    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = op["path"].strip("/").split("/")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) else last
        assert op["op"] in ("add", "replace"), op
        if op["op"] == "replace":
            assert (key < len(node)) if isinstance(node, list) else (key in node), op["path"]
        node[key] = op["value"]
    return doc


def keda_rayjob() -> dict[str, Any]:
    """The base RayJob with the overlay's patches applied, as `kustomize build` makes it."""
    (patch,) = keda("kustomization.yaml")["patches"]
    target, base = patch["target"], rayjob()
    assert base["apiVersion"] == f"{target['group']}/{target['version']}"
    assert (base["kind"], base["metadata"]["name"]) == (target["kind"], target["name"])
    return _json_patch(base, yaml.safe_load(patch["patch"]))


def keda_job_config() -> SlipstreamConfig:
    argv = shlex.split(keda_rayjob()["spec"]["entrypoint"])
    assert argv[:2] == ["slipstream", "run"], argv
    rest, overrides = split_overrides(argv[1:])
    return load_config(build_parser().parse_args(rest).config, overrides)


def _ray_start_slots(command: list[str], head: dict[str, Any]) -> int:
    """Ray CPU slots of a `ray start` that joins the Service `head` at its GCS port."""
    assert command[:2] == ["ray", "start"] and "--block" in command, command
    address = _flag(command, "--address")
    gcs = next(p for p in head["spec"]["ports"] if p["name"] == "gcs")
    assert address == f"{head['metadata']['name']}:{gcs['port']}"
    return int(_flag(command, "--num-cpus"))


def test_keda_overlay_lists_parseable_resources() -> None:
    kust = keda("kustomization.yaml")
    for rel in kust["resources"]:
        assert (DEPLOY / "keda" / rel).is_file(), rel
    assert keda("scaledobject.yaml")["apiVersion"] == "keda.sh/v1alpha1"
    assert [keda(f)["kind"] for f in ("trainer-service.yaml", "rollout-spot.yaml",
                                       "scaledobject.yaml")] == ["Service", "Deployment",
                                                                  "ScaledObject"]  # fmt: skip


def test_keda_job_is_the_base_job_with_metrics_and_every_slot_it_may_get() -> None:
    base, _ = job_config()
    cfg = keda_job_config()
    changed = {("run", "metrics_port"), ("run", "metrics_host"), ("rollout", "num_workers")}

    def rest(c: SlipstreamConfig) -> dict[str, Any]:
        d = c.model_dump(mode="json")
        for section, key in changed:
            del d[section][key]
        return d

    assert rest(cfg) == rest(base)  # the overlay drifts from nothing else of the base job
    svc = keda("trainer-service.yaml")
    metrics = next(p for p in svc["spec"]["ports"] if p["name"] == "metrics")
    assert cfg.run.metrics_host == "0.0.0.0"  # the pod IP, which the Service targets
    assert cfg.run.metrics_port == metrics["targetPort"]
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.run.metrics_port)
    # every slot: the RayJob's fixed rollout pods + the most pods KEDA may add
    (fixed,) = keda_rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert fixed["minReplicas"] == fixed["maxReplicas"] == fixed["replicas"]
    scaled = keda("scaledobject.yaml")
    pod = keda("rollout-spot.yaml")["spec"]["template"]
    slots = _ray_start_slots(container(pod, "ray-worker")["command"], svc)
    assert cfg.rollout.num_workers == (
        fixed["replicas"] * int(fixed["rayStartParams"]["num-cpus"])
        + scaled["spec"]["maxReplicaCount"] * slots
    )


def test_keda_scales_the_spot_deployment_on_series_the_job_exports() -> None:
    pytest.importorskip("prometheus_client")
    import httpx

    from s3util import free_port
    from slipstream.observe.prometheus import JobMetrics
    from slipstream.rl.buffer import ExperienceBuffer
    from slipstream.rl.coordinator import Coordinator
    from slipstream.rl.queue import TaskQueue

    cfg = keda_job_config()
    scaled, deployment = keda("scaledobject.yaml"), keda("rollout-spot.yaml")
    ref = scaled["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
    assert ref["name"] == deployment["metadata"]["name"]
    assert 0 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    # the names the exporter serves for a job (a live JobMetrics over a real coordinator)
    coord = Coordinator(TaskQueue(10), ExperienceBuffer(cfg.trainer.groups_per_step, 1))
    exporter = JobMetrics(free_port())
    try:
        exporter.watch(coord)
        text = httpx.get(exporter.url, timeout=10).text
    finally:
        exporter.close()
    served = set(re.findall(r"^(slipstream_\w+)", text, re.M))
    triggers = scaled["spec"]["triggers"]
    for t in triggers:
        assert t["type"] == "prometheus"
        names = set(re.findall(r"slipstream_\w+", t["metadata"]["query"]))
        assert names and names <= served, (names, sorted(served))
    demand = next(t for t in triggers if "rollout_demand_tasks" in t["metadata"]["query"])
    # one pod per what it holds: max_inflight_tasks per Ray slot
    svc = keda("trainer-service.yaml")
    slots = _ray_start_slots(container(deployment["spec"]["template"], "ray-worker")["command"],
                             svc)  # fmt: skip
    assert float(demand["metadata"]["threshold"]) == cfg.rollout.max_inflight_tasks * slots
    assert demand.get("metricType", "AverageValue") == "AverageValue"


def test_keda_rollout_pods_join_the_head_and_equal_the_rayjob_rollout_pod() -> None:
    svc = keda("trainer-service.yaml")
    job = keda_rayjob()["spec"]["rayClusterSpec"]
    head_labels = job["headGroupSpec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= head_labels.items()
    deployment = keda("rollout-spot.yaml")["spec"]
    assert deployment["selector"]["matchLabels"].items() <= deployment["template"]["metadata"][
        "labels"].items()  # fmt: skip
    assert not (deployment["template"]["metadata"]["labels"].items() & head_labels.items())
    pod = deployment["template"]
    (fixed,) = job["workerGroupSpecs"]
    slots = _ray_start_slots(container(pod, "ray-worker")["command"], svc)
    assert slots == int(fixed["rayStartParams"]["num-cpus"])

    def without_ray_command(spec: dict[str, Any]) -> dict[str, Any]:
        spec = yaml.safe_load(yaml.safe_dump(spec))
        container({"spec": spec}, "ray-worker").pop("command", None)
        return spec

    # the same pod as the RayJob's rollout group (node group, Spot drain, SGLang, volumes, the
    # sandbox agent's socket), but for the `ray start` KubeRay writes for its own pods
    assert without_ray_command(pod["spec"]) == without_ray_command(fixed["template"]["spec"])


def test_reward_model_service_is_a_valid_serve_the_job_can_reach() -> None:
    deployment, service = load("kuberay/rm-server.yaml")
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    pod = deployment["spec"]["template"]
    c = container(pod, "rm-server")
    argv = c["command"]
    assert argv[:2] == ["slipstream", "serve"]
    rest, overrides = split_overrides(argv[1:])
    args = build_parser().parse_args(rest)
    load_config(args.config, overrides)
    port = int(next(a for a in argv if a.startswith("--port=")).split("=", 1)[1])
    assert [p["containerPort"] for p in c["ports"]] == [port]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert mount_of(c, args.model + "/config.json") == "rm"
    # its own node group, whose taints it tolerates
    g = node_groups()["reward"]
    selector = pod["spec"]["nodeSelector"]
    assert all(g["labels"].get(k) == v for k, v in selector.items())
    tolerated = {(t["key"], t["effect"]) for t in pod["spec"]["tolerations"]}
    assert {(t["key"], t["effect"]) for t in g.get("taints", [])} <= tolerated
    assert "spot" not in g
    # the job's overrides load on top of the RayJob's and point at this Service's port
    cfg, job_overrides = job_config()
    extra = shlex.split(deployment["metadata"]["annotations"]["slipstream.io/job-overrides"])
    _, extra_overrides = split_overrides(extra)
    rl = load_config(None, [*job_overrides, *extra_overrides])
    assert rl.reward.source == "reward_model"
    assert (
        rl.reward.url
        == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    )
    assert service["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
