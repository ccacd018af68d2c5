"""The TorchX component (launch/torchx.py) offline: the seed-sized job (`-j 4x8`, 32 rollout
workers, an s3:// store) dry-run for the kubernetes scheduler, the way `torchx run --dryrun -s
kubernetes -cfg queue=default,service_account=slipstream
src/slipstream/launch/torchx.py:rl ...` does it (TorchX's runner,
its component parser and linter, its Volcano Job), then every pod checked against the Kubernetes
schema (kubernetes-validate) and for what matters per role: GPU and EFA requests, node groups,
tolerations, grace period, retries, and the command and env that wire the roles together. No
cluster here: nothing is applied."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from slipstream.cli import build_parser, split_overrides
from slipstream.config import load_config

torchx = pytest.importorskip("torchx")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

from torchx.runner import get_runner  # noqa: E402

from slipstream.launch import torchx as component  # noqa: E402
from slipstream.launch.worker import (  # noqa: E402
    COORDINATOR_AUTHKEY_ENV,
    COORDINATOR_HOST_ENV,
    COORDINATOR_PORT_ENV,
)

REPO = Path(__file__).resolve().parents[2]
COMPONENT = f"{REPO / 'src/slipstream/launch/torchx.py'}:rl"
K8S_VERSION = "1.33"  # the EKS version of deploy/eks/cluster.yaml
SEED = ["-j", "4x8", "--num_rollout_workers", "32", "--store", "s3://my-bucket/slipstream/run",
        "--", "--trainer.groups_per_step=64", "--model.init_from=/init"]  # fmt: skip
# torchx's note on Volcano's retries, for every role with max_retries
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:torchx.schedulers.kubernetes_scheduler"
)


def dryrun(args: list[str]) -> dict[str, Any]:
    """The Volcano Job `torchx run --dryrun -s kubernetes` prints (TorchX's own, as dicts)."""
    from kubernetes.client import ApiClient

    info = get_runner().dryrun_component(
        COMPONENT, args, "kubernetes", cfg={"queue": "default", "service_account": "slipstream"}
    )
    return ApiClient().sanitize_for_serialization(info.request.resource)


def full_output(args: list[str]) -> str:
    """What `python -m slipstream.launch.torchx --queue default -- ARGS` prints."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert component.main(["--queue", "default", "--", *args]) == 0
    return out.getvalue()


def full_job(args: list[str]) -> dict[str, Any]:
    """The Volcano Job of that output (parsed back): its last document."""
    return list(yaml.safe_load_all(full_output(args)))[-1]


def pods(job: dict[str, Any], role: str) -> list[dict[str, Any]]:
    label = "torchx.pytorch.org/role-name"
    return [t["template"] for t in job["spec"]["tasks"] if t["template"]["metadata"]["labels"][label] == role]  # fmt: skip


def tasks(job: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return [t for t in job["spec"]["tasks"] if t["name"].startswith(f"{role}-")]


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    """name -> value (a string), or its `valueFrom` (a dict)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}  # fmt: skip


def shell_command(pod: dict[str, Any]) -> list[str]:
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["bash", "-c"], command
    return shlex.split(command[2])


def node_groups() -> dict[str, dict[str, Any]]:
    (cluster,) = [
        d for d in yaml.safe_load_all((REPO / "deploy/eks/cluster.yaml").read_text()) if d
    ]
    return {g["name"]: g for g in cluster["managedNodeGroups"]}


def validate_pod(pod: dict[str, Any]) -> None:
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "Pod", **pod}, K8S_VERSION, strict=True
    )


@pytest.fixture(scope="module")
def stock() -> dict[str, Any]:
    return dryrun(SEED)


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    return full_job(SEED)


def test_dry_run_is_one_volcano_job_of_4_trainer_and_32_rollout_pods(stock: dict[str, Any]) -> None:
    assert stock["apiVersion"] == "batch.volcano.sh/v1alpha1" and stock["kind"] == "Job"
    assert stock["spec"]["schedulerName"] == "volcano" and stock["spec"]["queue"] == "default"
    assert [t["name"] for t in stock["spec"]["tasks"]] == [
        *(f"trainer-{i}" for i in range(4)), *(f"rollout-{i}" for i in range(32))]  # fmt: skip
    for task in stock["spec"]["tasks"]:
        assert task["replicas"] == 1
        validate_pod(task["template"])  # the Kubernetes schema, strict: no unknown fields


def _without_placement(job: dict[str, Any]) -> str:
    """The job as JSON with what kubernetes_resource adds removed (placement, the authkey's
    Secret reference, the coordinator's address, the security context) and what differs between
    two calls of the component (the unique app id) masked."""
    import copy
    import json

    job = copy.deepcopy(job)
    added_env = {COORDINATOR_AUTHKEY_ENV, COORDINATOR_HOST_ENV, "HOME"}
    for task in job["spec"]["tasks"]:
        task.pop("policies", None)
        spec = task["template"]["spec"]
        for key in ("tolerations", "terminationGracePeriodSeconds", "securityContext",
                    "automountServiceAccountToken"):  # fmt: skip
            spec.pop(key, None)
        spec["nodeSelector"].pop(component.NODE_GROUP_LABEL, None)
        container = spec["containers"][0]
        container["env"] = [e for e in container["env"] if e["name"] not in added_env]
        container.pop("securityContext", None)
    return json.dumps(job, sort_keys=True).replace(job["metadata"]["name"], "APP")


def test_completed_job_is_schema_valid_and_only_adds_placement(stock: dict[str, Any],
                                                               job: dict[str, Any]) -> None:  # fmt: skip
    for task in job["spec"]["tasks"]:
        validate_pod(task["template"])
    stock = {**stock, "spec": {**stock["spec"], "tasks": [
        {k: v for k, v in t.items() if k != "policies"} for t in stock["spec"]["tasks"]]}}  # fmt: skip
    assert _without_placement(job) == _without_placement(stock)


def test_trainer_pods_ask_8_gpus_and_32_efa_on_the_stable_trainer_group(
    job: dict[str, Any],
) -> None:
    groups = node_groups()
    trainer, rollout = groups["trainer"], groups["rollout"]
    assert not trainer.get("spot") and trainer["efaEnabled"] and rollout["spot"]
    for pod in pods(job, "trainer"):
        spec = pod["spec"]
        res = spec["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "8"
        assert res["limits"]["vpc.amazonaws.com/efa"] == "32"
        assert spec["nodeSelector"] == {
            "slipstream.io/role": trainer["labels"]["slipstream.io/role"],
            "node.kubernetes.io/instance-type": trainer["instanceType"],
        }
        taint = trainer["taints"][0]
        assert spec["tolerations"] == [{"key": taint["key"], "operator": "Exists", "effect": taint["effect"]}]  # fmt: skip
        assert env_of(pod)["FI_PROVIDER"] == "efa"
        assert spec["serviceAccountName"] == "slipstream"  # IRSA: the S3 store


def test_rollout_pods_are_spot_workers_that_drain_within_their_grace_period(job: dict[str, Any]) -> None:  # fmt: skip
    rollout = node_groups()["rollout"]
    cfg = load_config(REPO / "configs/quickstart.toml")
    for pod in pods(job, "rollout"):
        spec = pod["spec"]
        res = spec["containers"][0]["resources"]
        assert (
            res["requests"]["nvidia.com/gpu"] == "1"
            and "vpc.amazonaws.com/efa" not in res["limits"]
        )
        assert spec["nodeSelector"] == {
            "slipstream.io/role": rollout["labels"]["slipstream.io/role"]
        }
        taint = rollout["taints"][0]
        assert spec["tolerations"] == [{"key": taint["key"], "operator": "Exists", "effect": taint["effect"]}]  # fmt: skip
        # SIGTERM -> the worker drains for rollout.drain_timeout_s, then nacks and reports
        assert spec["terminationGracePeriodSeconds"] >= cfg.rollout.drain_timeout_s + 20


def test_a_lost_rollout_pod_restarts_alone_a_trainer_failure_restarts_the_job(job: dict[str, Any]) -> None:  # fmt: skip
    for task in tasks(job, "rollout"):
        assert task["maxRetry"] == 100
        assert {p["event"]: p["action"] for p in task["policies"]} == {
            "PodEvicted": "RestartTask", "PodFailed": "RestartTask"}  # fmt: skip
    for task in tasks(job, "trainer"):
        assert task["maxRetry"] == 3
        assert {p["action"] for p in task["policies"]} == {"RestartJob"}
    assert job["spec"]["maxRetry"] == 3


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_trainer_ranks_rendezvous_like_dist_ddp_and_run_slipstream_run(job: dict[str, Any]) -> None:
    app_id = job["metadata"]["name"]
    for pod in pods(job, "trainer"):
        argv = shell_command(pod)
        assert argv[0] == "torchrun"
        assert _flag(argv, "--nnodes") == "4" and _flag(argv, "--nproc_per_node") == "8"
        assert _flag(argv, "--rdzv_backend") == "c10d" and _flag(argv, "--rdzv_id") == app_id
        # replica 0 hosts the store; the others find it by Volcano's name for it
        host, port = _flag(argv, "--rdzv_endpoint").rsplit(":", 1)
        assert port == "29500"
        assert host == ("${TORCHX_RANK0_HOST:=localhost}" if pod is pods(job, "trainer")[0]
                        else "${VC_TRAINER_0_HOSTS:=localhost}")  # fmt: skip
        cmd = argv[argv.index("--no-python") + 1 :]
        assert cmd[:2] == ["slipstream", "run"]
        rest, overrides = split_overrides(cmd[1:])
        args = build_parser().parse_args(rest)  # this CLI accepts it
        cfg = load_config(args.config, overrides)
        assert cfg.run.launcher == "torchx" and cfg.trainer.num_processes == 32
        assert cfg.rollout.num_workers == 32 and cfg.store.url == "s3://my-bucket/slipstream/run"
        assert {"c10d": 29500, "coordinator": 29600} == {
            p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}  # fmt: skip


def test_rollout_workers_find_the_coordinator_by_the_trainers_service_name(job: dict[str, Any]) -> None:  # fmt: skip
    trainer0 = pods(job, "trainer")[0]
    refs = [env_of(p)[COORDINATOR_AUTHKEY_ENV] for p in pods(job, "trainer") + pods(job, "rollout")]
    secret = component.authkey_secret_name(job["metadata"]["name"])  # one key, this job's
    assert all(r == {"secretKeyRef": {"name": secret, "key": "authkey"}} for r in refs)
    for i, pod in enumerate(pods(job, "rollout")):
        argv = shell_command(pod)
        assert argv[:3] == ["python", "-m", "slipstream.launch.worker"]
        host, port = _flag(argv, "--coordinator").rsplit(":", 1)
        assert host == "${VC_TRAINER_0_HOSTS:=localhost}"  # Volcano: trainer replica 0's DNS name
        assert port == env_of(pod)[COORDINATOR_PORT_ENV] == env_of(trainer0)[COORDINATOR_PORT_ENV]
        assert _flag(argv, "--slot") == str(i)
        # the same config and overrides as the trainer ranks
        overrides = [a[2:] for a in argv if a.startswith("--") and "=" in a]
        cfg = load_config(_flag(argv, "-c"), overrides)
        assert cfg.store.url == "s3://my-bucket/slipstream/run" and cfg.run.launcher == "torchx"
    trainer_tail = shell_command(trainer0)[-8:]
    assert shell_command(pods(job, "rollout")[0])[-8:] == trainer_tail


def test_image_and_node_groups_are_deploys() -> None:
    assert component.DEFAULT_IMAGE in (REPO / "deploy/kuberay/rayjob-moe.yaml").read_text()
    assert "deploy/Dockerfile.gpu" in (REPO / "deploy/kuberay/rayjob-moe.yaml").read_text()
    groups = node_groups()
    assert groups[component.TRAINER_NODE_GROUP]["instanceType"] == component.TRAINER_INSTANCE_TYPE
    for name in (component.TRAINER_NODE_GROUP, component.ROLLOUT_NODE_GROUP):
        assert groups[name]["labels"][component.NODE_GROUP_LABEL] == name
        assert groups[name]["taints"][0]["key"] == component.GPU_TAINT


def test_the_authkey_is_in_the_jobs_secret_and_the_pods_run_unprivileged() -> None:
    """The coordinator unpickles what an authkey holder sends: the key is in a per-job Secret
    (never a value in a pod spec, which whoever reads the Job or its pods sees), the coordinator
    binds the trainer pod's IP, only the job's pods reach its pods, and no pod runs as root,
    escalates privileges or keeps a capability it does not need."""
    docs = list(yaml.safe_load_all(full_output(["-j", "2x2", "--num_rollout_workers", "3", "--",
                                                "--model.init_from=/init"])))  # fmt: skip
    assert [d["kind"] for d in docs] == ["Secret", "NetworkPolicy", "Job"]
    secret, policy, job = docs
    app = job["metadata"]["name"]
    for doc in (secret, policy):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert secret["metadata"]["name"] == component.authkey_secret_name(app)
    key = secret["stringData"]["authkey"]
    assert re.fullmatch("[0-9a-f]{32}", key) and key not in yaml.safe_dump(job)
    job_pods = {"matchLabels": {component.JOB_LABEL: app}}
    assert policy["spec"]["podSelector"] == job_pods
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": job_pods}]}]
    for role in ("trainer", "rollout"):
        for pod in pods(job, role):
            assert pod["metadata"]["labels"][component.JOB_LABEL] == app
            validate_pod(pod)
            env = env_of(pod)
            assert env[COORDINATOR_AUTHKEY_ENV] == {
                "secretKeyRef": {"name": secret["metadata"]["name"], "key": "authkey"}}  # fmt: skip
            assert all(not isinstance(v, str) or key not in v for v in env.values())
            spec, sc = pod["spec"], pod["spec"]["containers"][0]["securityContext"]
            assert (
                spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] > 0
            )
            assert spec["automountServiceAccountToken"] is False
            assert sc["allowPrivilegeEscalation"] is False and not sc["privileged"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if role == "trainer" else [])
            # the coordinator (trainer rank 0) binds the pod's own address, not 0.0.0.0
            host = env.get(COORDINATOR_HOST_ENV)
            assert host == (
                {"fieldRef": {"fieldPath": "status.podIP"}} if role == "trainer" else None
            )
    # a local scheduler still passes the key in the processes' environment
    stock = dryrun(["-j", "1x1", "--num_rollout_workers", "1"])
    assert re.fullmatch("[0-9a-f]{32}", env_of(pods(stock, "rollout")[0])[COORDINATOR_AUTHKEY_ENV])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-j", "4"], "-j must be {nnodes}x{nproc_per_node}"),
        (["-j", "0x8"], "-j must be"),
        (["--num_rollout_workers", "0"], "--num_rollout_workers must be >= 1"),
        (["--coordinator_port", "70000"], "--coordinator_port must be a TCP port"),
        (["--", "--trainer.nope=1"], "trainer.nope"),
        (["--", "trainer.steps=1"], "overrides are --key=value"),
        (["-j", "2x8", "--", "--trainer.groups_per_step=64"], "need model.init_from"),
        (["-j", "1x3"], "trainer.groups_per_step (8) must be a multiple of trainer.num_processes"),
    ],
)
def test_bad_arguments_fail_before_submission_naming_them(args: list[str], message: str,
                                                          capsys) -> None:  # fmt: skip
    from torchx.specs.finder import ComponentValidationException

    # the kind `torchx run` prints as one line (any other exception: a traceback)
    with pytest.raises(ComponentValidationException, match=re.escape(message)):
        dryrun(args)
    assert component.main(["--queue", "default", "--", *args]) == 2
    out = capsys.readouterr()
    assert not out.out and message in out.err and out.err.count("\n") == 1


def test_deploy_readme_commands_dry_run() -> None:
    """deploy/README.md's commands are ones this component takes: the `python -m` submission
    (Secret, NetworkPolicy, Job) and the `torchx run --dryrun -s kubernetes` check, which passes
    `--workspace ""` (torchx's default workspace builds an image: a Docker daemon)."""
    text = (REPO / "deploy/README.md").read_text()
    block = next(
        b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "launch/torchx.py:rl" in b
    )
    lines = [c.replace("$REGISTRY", "registry.example")
             for c in block.replace("\\\n", " ").splitlines() if c and not c.startswith("#")]  # fmt: skip
    submit = next(c for c in lines if c.startswith("python -m slipstream.launch.torchx"))
    command, pipe = submit.split(" | ")
    assert pipe.split()[:3] == ["kubectl", "apply", "-n"] and pipe.endswith("-f -")
    docs = list(yaml.safe_load_all(full_output(shlex.split(command)[8:])))
    assert shlex.split(command)[3:8] == [
        "--queue",
        "default",
        "--service_account",
        "slipstream",
        "--",
    ]
    assert [d["kind"] for d in docs] == ["Secret", "NetworkPolicy", "Job"]
    check = shlex.split(
        next(c for c in lines if "launch/torchx.py:rl" in c and c.startswith("torchx"))
    )
    assert check[:5] == ["torchx", "run", "--dryrun", "-s", "kubernetes"]
    assert check[check.index("--workspace") + 1] == ""
    args = check[check.index("src/slipstream/launch/torchx.py:rl") + 1 :]
    assert args == shlex.split(command)[8:]  # the same job both ways
    for job in (dryrun(args), docs[-1]):
        trainer = pods(job, "trainer")[0]
        assert trainer["spec"]["containers"][0]["image"] == "registry.example/slipstream:0.1.0-gpu"
        mounts = {m["mountPath"] for m in trainer["spec"]["containers"][0]["volumeMounts"]}
        assert "/init" in mounts
        assert len(pods(job, "rollout")) == 32 and len(pods(job, "trainer")) == 4
