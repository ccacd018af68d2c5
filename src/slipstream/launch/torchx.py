"""The TorchX component of a slipstream RL job (the `torchx` extra), launched the way seed 000
launches its job:

    torchx run -s kubernetes -cfg queue=default,service_account=slipstream \\
        src/slipstream/launch/torchx.py:rl -j 4x8 --config configs/quickstart.toml \\
        --num_rollout_workers 32 --store s3://BUCKET/slipstream/run -- --model.init_from=...
    torchx run -s local_cwd src/slipstream/launch/torchx.py:rl -j 1x1 --num_rollout_workers 2

(TorchX 0.7 reads `X:fn` as FILE:FUNCTION, so the component is named by its path in a checkout;
the module form `slipstream.launch.torchx:rl` is not found.)

`rl` returns an AppDef of two roles (what they run: launch/scheduled.py):

- `trainer`: N replicas (nodes) x G processes (GPUs) from `-j NxG`, each replica a `torchrun`
  with TorchX `dist.ddp`'s c10d rendezvous on trainer replica 0, every rank running
  `slipstream run` with run.launcher = "torchx" and trainer.num_processes = N*G. Per replica G
  GPUs, the EFA interfaces of a p5.48xlarge, on the stable (on-demand) trainer node group.
  Retries restart the whole job (it resumes from its last checkpoint in the store).
- `rollout`: `--num_rollout_workers` replicas of one rollout worker each
  (`python -m slipstream.launch.worker --coordinator ...`), one GPU each, on the Spot rollout
  node group; a lost one is replaced by itself (retry policy REPLICA), the trainer keeps running.
  The pod's termination grace period covers the worker's SIGTERM drain
  (rollout.drain_timeout_s + DRAIN_MARGIN_S).
- Wiring: the coordinator on trainer rank 0 at `--coordinator_port`, found by the rollout role
  through the scheduler's name for trainer replica 0 (TorchX's rank-0 variable; on Kubernetes the
  Volcano job's service DNS name `VC_TRAINER_0_HOSTS`), guarded by an authkey made here for
  this job; both roles get the same config file and overrides, and `--store` (store.url;
  `s3://` on Kubernetes) holds the checkpoints and the weights the workers load.

Node groups, taints, instance type and image are deploy/'s (`deploy/eks/cluster.yaml`,
`deploy/Dockerfile.gpu` as REGISTRY/slipstream:0.1.0-gpu). TorchX 0.7's kubernetes scheduler
turns a role into a pod with its resources (GPU, CPU, memory, devices: EFA), env, ports and an
instance-type node selector, but has no node-label selector, toleration or grace period: those
are in each role's metadata (`POD_KEY`) and `kubernetes_resource` adds them to the Volcano Job
(`python -m slipstream.launch.torchx ... > job.yaml; kubectl apply -f job.yaml`). Never applied
to a cluster (none here): the resources are schema-checked in tests/unit/test_launch_torchx.py.
"""

import argparse
import copy
import math
import secrets
import shlex
import sys

# TorchX 0.7 reads a component's signature with typing's forms (Optional, Dict), not `X | None`
from typing import Any, Dict, List, Optional  # noqa: UP035

from torchx import specs
from torchx.specs import macros
from torchx.specs.finder import ComponentValidationException

from slipstream.launch.worker import (
    COORDINATOR_AUTHKEY_ENV,
    COORDINATOR_HOST_ENV,
    COORDINATOR_PORT_ENV,
)

# deploy/'s names (deploy/eks/cluster.yaml, deploy/Dockerfile.gpu); tests/unit/test_launch_torchx.py
# keeps them in step with those files.
DEFAULT_IMAGE = "REGISTRY/slipstream:0.1.0-gpu"
NODE_GROUP_LABEL = "slipstream.io/role"
TRAINER_NODE_GROUP = "trainer"  # on-demand p5.48xlarge, EFA
ROLLOUT_NODE_GROUP = "rollout"  # Spot p5/p5e
TRAINER_INSTANCE_TYPE = "p5.48xlarge"
GPU_TAINT = "nvidia.com/gpu"  # both GPU node groups' NoSchedule taint
EFA_RESOURCE = "vpc.amazonaws.com/efa"
EFA_PER_NODE = 32  # a p5.48xlarge's EFA interfaces
# TorchX's memMB is Kubernetes' "M" (10^6 bytes); a p5.48xlarge has 2 TiB
TRAINER_CPU, TRAINER_MEM_MB = 96, 1_500_000  # a trainer node, about deploy/kuberay's head pod
ROLLOUT_CPU, ROLLOUT_MEM_MB = 8, 64_000  # one rollout worker and its GPU
DRAIN_MARGIN_S = 30  # grace beyond rollout.drain_timeout_s: nacks, final report, sandboxes
POD_KEY = "slipstream.io/pod"  # role metadata: what kubernetes_resource adds to the role's pods
# Volcano task policies of a role retried per replica (TorchX 0.7 gives such a task maxRetry but
# no policy): a rollout pod that failed or was evicted (Spot) is restarted alone.
REPLICA_POLICIES = [{"event": "PodEvicted", "action": "RestartTask"},
                    {"event": "PodFailed", "action": "RestartTask"}]  # fmt: skip
COORDINATOR_PORT = 29600
RDZV_PORT = 29500
JOB_LABEL = "app.kubernetes.io/instance"  # TorchX's label of every pod of one app (its id)
AUTHKEY_SECRET_KEY = "authkey"  # the key of the job's Secret that holds the coordinator's authkey
POD_UID = 1000  # the non-root user the pods run as (the image runs as root otherwise)
# What a pod may do: no privilege escalation, no Linux capability but what a role needs (the
# trainer's EFA/RDMA memory registration locks pages: IPC_LOCK). The rollout pods run their
# bwrap sandboxes in unprivileged user namespaces, which the runtime's default seccomp profile
# refuses (unshare(CLONE_NEWUSER) needs CAP_SYS_ADMIN there): seccomp RuntimeDefault is the
# trainer's only.
TRAINER_CAPABILITIES = ["IPC_LOCK"]


class JobArgumentError(ComponentValidationException, ValueError):
    """A bad argument or config of the component, in one line: `torchx run` prints this kind
    as its own error (a line, no traceback) and exits 1."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def _resolve(config: str, overrides: list[str]) -> Any:
    """The job's config as every role will load it: checked here, before anything is submitted
    (a bad key fails the `torchx run`, naming it)."""
    from slipstream.config import load_config

    try:
        return load_config(config, [o[2:] if o.startswith("--") else o for o in overrides])
    except ValueError as e:  # ConfigError, a missing file's message
        raise JobArgumentError(str(e)) from None
    except OSError as e:
        raise JobArgumentError(f"--config {config}: {e.strerror or e}") from None


def rl(
    *overrides: str,
    j: str = "1x1",
    config: str = "configs/quickstart.toml",
    num_rollout_workers: int = 4,
    store: Optional[str] = None,  # noqa: UP045
    image: str = DEFAULT_IMAGE,
    name: str = "slipstream-rl",
    rollout_gpus: int = 1,
    max_retries: int = 3,
    rollout_max_retries: int = 100,
    coordinator_port: int = COORDINATOR_PORT,
    rdzv_port: int = RDZV_PORT,
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045
    mounts: Optional[List[str]] = None,  # noqa: UP006, UP045
) -> specs.AppDef:
    """A slipstream RL job: trainer ranks (torchrun) and rollout workers as two roles.

    Args:
        overrides: config overrides for every role, `--key=value` (after `--`)
        j: trainer ranks as {nnodes}x{nproc_per_node}; one GPU per rank
        config: the job's config file (the same path in the image)
        num_rollout_workers: rollout workers (replicas of the rollout role)
        store: store.url for checkpoints and weights (s3://... on Kubernetes)
        image: container image of both roles
        name: job name
        rollout_gpus: GPUs per rollout worker
        max_retries: restarts of the whole job after a trainer failure (it resumes)
        rollout_max_retries: replacements of each rollout worker (Spot), trainer untouched
        coordinator_port: port of the coordinator on trainer rank 0
        rdzv_port: torchrun's c10d rendezvous port on trainer replica 0 (several nodes)
        env: extra environment of both roles
        mounts: volumes of both roles, as dist.ddp's (type=volume,src=PVC,dst=/path): e.g. the
            start checkpoint model.init_from names, which ranks on several nodes need
    """
    nnodes, nproc = _parse_j(j)
    for arg, value, low in (("num_rollout_workers", num_rollout_workers, 1),
                            ("rollout_gpus", rollout_gpus, 0), ("max_retries", max_retries, 0),
                            ("rollout_max_retries", rollout_max_retries, 0)):  # fmt: skip
        if value < low:
            raise JobArgumentError(f"--{arg} must be >= {low}, got {value}")
    for arg, port in (("coordinator_port", coordinator_port), ("rdzv_port", rdzv_port)):
        if not 1 <= port <= 65535:
            raise JobArgumentError(f"--{arg} must be a TCP port (1..65535), got {port}")
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        raise JobArgumentError(f"overrides are --key=value, got {bad}")
    wiring = [
        "--run.launcher=torchx",
        f"--trainer.num_processes={nnodes * nproc}",
        f"--rollout.num_workers={num_rollout_workers}",
    ] + ([f"--store.url={store}"] if store else [])
    job_overrides = list(overrides) + wiring  # the component's wiring wins over a user's
    cfg = _resolve(config, job_overrides)
    if nnodes > 1 and not cfg.model.init_from:
        raise JobArgumentError(
            f"-j {j}: trainer ranks on {nnodes} nodes need model.init_from (a start checkpoint "
            "every node reads, e.g. on a volume given with --mounts): without it rank 0 trains "
            "the SFT start in its own pod, where the other nodes cannot read it"
        )
    role_mounts = specs.parse_mounts(mounts) if mounts else []
    role_env = {
        "LOGLEVEL": "WARNING",
        **(env or {}),
        COORDINATOR_PORT_ENV: str(coordinator_port),
        # this job's; a local scheduler passes it in the processes' environment, on Kubernetes
        # kubernetes_resources moves it into the job's Secret (never a pod spec's value)
        COORDINATOR_AUTHKEY_ENV: secrets.token_hex(16),
    }
    if nnodes == 1:  # one agent: any free port (as dist.ddp)
        endpoint = "localhost:0"
    else:  # trainer replica 0, by the scheduler's name for it
        endpoint = f"$${{{macros.rank0_env}:=localhost}}:{rdzv_port}"
    torchrun = [
        "torchrun", "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
        "--rdzv_id", macros.app_id, "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
        "--tee", "3", "--role", "trainer", "--no-python",
        "slipstream", "run", "--plain", "-c", config, *job_overrides,
    ]  # fmt: skip
    worker = [
        "python", "-m", "slipstream.launch.worker",
        "--coordinator", f"$${{{macros.rank0_env}:=localhost}}:{coordinator_port}",
        "--slot", macros.replica_id, "-c", config, *job_overrides,
    ]  # fmt: skip
    gpu_toleration = {"key": GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"}
    trainer = specs.Role(
        name="trainer",
        image=image,
        entrypoint="bash",
        args=["-c", _join(torchrun)],
        num_replicas=nnodes,
        resource=specs.Resource(
            cpu=TRAINER_CPU,
            gpu=nproc,
            memMB=TRAINER_MEM_MB,
            capabilities={"node.kubernetes.io/instance-type": TRAINER_INSTANCE_TYPE},
            devices={EFA_RESOURCE: EFA_PER_NODE},
        ),
        env={**role_env, "FI_PROVIDER": "efa"},
        port_map={"c10d": rdzv_port, "coordinator": coordinator_port},
        max_retries=max_retries,
        retry_policy=specs.RetryPolicy.APPLICATION,
        mounts=role_mounts,
        metadata={
            POD_KEY: {
                "nodeSelector": {NODE_GROUP_LABEL: TRAINER_NODE_GROUP},
                "tolerations": [gpu_toleration],
            }
        },  # fmt: skip
    )
    rollout = specs.Role(
        name="rollout",
        image=image,
        entrypoint="bash",
        args=["-c", _join(worker)],
        num_replicas=num_rollout_workers,
        resource=specs.Resource(cpu=ROLLOUT_CPU, gpu=rollout_gpus, memMB=ROLLOUT_MEM_MB),
        env=role_env,
        max_retries=rollout_max_retries,
        retry_policy=specs.RetryPolicy.REPLICA,
        mounts=role_mounts,
        metadata={
            POD_KEY: {
                "nodeSelector": {NODE_GROUP_LABEL: ROLLOUT_NODE_GROUP},
                "tolerations": [gpu_toleration],
                # SIGTERM drains the worker (launch/worker.py); the pod is killed only after this
                "terminationGracePeriodSeconds": math.ceil(cfg.rollout.drain_timeout_s)
                + DRAIN_MARGIN_S,
            }
        },  # fmt: skip
    )
    return specs.AppDef(name=name, roles=[trainer, rollout])  # trainer first: rank 0's name


def _parse_j(j: str) -> tuple[int, int]:
    nnodes, sep, nproc = j.partition("x")
    if not (sep and nnodes.isdigit() and nproc.isdigit() and int(nnodes) > 0 and int(nproc) > 0):
        raise JobArgumentError(
            f"-j must be {{nnodes}}x{{nproc_per_node}} with both >= 1, got {j!r}"
        )
    return int(nnodes), int(nproc)


def _join(argv: list[str]) -> str:
    """A shell command line; `$${VAR:=default}` parts (TorchX macros, expanded by bash in the
    container) stay unquoted."""
    return " ".join(a if a.startswith("$${") else shlex.quote(a) for a in argv)


def kubernetes_resources(app: specs.AppDef, queue: str, service_account: str | None = None
                         ) -> list[dict[str, Any]]:  # fmt: skip
    """What `kubectl apply` takes for `app`, in order: the job's Secret (the coordinator's
    authkey), a NetworkPolicy that admits to the job's pods only the job's own pods, and the
    Volcano Job (kubernetes_resource) whose pods read the authkey from that Secret."""
    job = kubernetes_resource(app, queue, service_account)
    app_id = job["metadata"]["name"]
    (authkey,) = {role.env[COORDINATOR_AUTHKEY_ENV] for role in app.roles}
    labels = {JOB_LABEL: app_id, "app.kubernetes.io/managed-by": "slipstream"}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": authkey_secret_name(app_id), "labels": labels},
        "type": "Opaque",
        "stringData": {AUTHKEY_SECRET_KEY: authkey},
    }
    # The coordinator unpickles what an authkey holder sends and the trainers' c10d store and
    # NCCL bootstrap listen on every port they like: only this job's pods may connect to them.
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{app_id}-pods", "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": {JOB_LABEL: app_id}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {JOB_LABEL: app_id}}}]}],
        },
    }
    return [secret, policy, job]


def authkey_secret_name(app_id: str) -> str:
    return f"{app_id}-coordinator"


def kubernetes_resource(app: specs.AppDef, queue: str, service_account: str | None = None
                        ) -> dict[str, Any]:  # fmt: skip
    """The Volcano Job `torchx run -s kubernetes -cfg queue=...,service_account=...` submits for
    `app` (TorchX's runner and kubernetes scheduler, dry run), plus what TorchX 0.7 does not
    express: each role's POD_KEY settings (node selector by node group, tolerations, grace
    period), the per-replica restart policy of the rollout tasks, the coordinator's authkey
    from the job's Secret (`secretKeyRef`; TorchX writes env values into the pod spec), the
    coordinator bound to the trainer pod's own IP, and a restrictive security context
    (non-root, no privilege escalation, capabilities dropped); -> JSON-able dicts."""
    from kubernetes.client import ApiClient
    from torchx.runner import get_runner
    from torchx.schedulers.kubernetes_scheduler import LABEL_ROLE_NAME

    cfg = {"queue": queue, **({"service_account": service_account} if service_account else {})}
    with get_runner() as runner:
        request = runner.dryrun(app, "kubernetes", cfg=cfg).request
    resource = ApiClient().sanitize_for_serialization(request.resource)
    secret = authkey_secret_name(resource["metadata"]["name"])
    roles = {role.name: role for role in app.roles}
    for task in resource["spec"]["tasks"]:
        template = task["template"]
        role = roles[template["metadata"]["labels"][LABEL_ROLE_NAME]]
        if role.max_retries > 0 and role.retry_policy == specs.RetryPolicy.REPLICA:
            task["policies"] = copy.deepcopy(REPLICA_POLICIES)
        extra = copy.deepcopy(role.metadata.get(POD_KEY, {}))  # each pod its own (no YAML aliases)
        spec = template["spec"]
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **extra.pop("nodeSelector", {})}
        spec.update(extra)
        _restrict(spec, role.name, secret)
    return resource


def _restrict(spec: dict[str, Any], role: str, secret: str) -> None:
    """One pod of the job: the authkey from the Secret, the coordinator on the pod's IP, least
    privilege."""
    (container,) = spec["containers"]
    if (container.get("securityContext") or {}).get("privileged"):
        raise JobArgumentError(
            f"role {role}: a device mount (--mounts type=device) makes TorchX's pod privileged; "
            "this job's pods run unprivileged (EFA comes as a resource, not a device mount)"
        )
    env = [
        e
        for e in container["env"]
        if e["name"] not in (COORDINATOR_AUTHKEY_ENV, COORDINATOR_HOST_ENV)
    ]
    env.append({"name": COORDINATOR_AUTHKEY_ENV, "valueFrom": {
        "secretKeyRef": {"name": secret, "key": AUTHKEY_SECRET_KEY}}})  # fmt: skip
    if role == "trainer":  # rank 0 serves the coordinator where the rollout pods reach it only
        env.append({"name": COORDINATOR_HOST_ENV, "valueFrom": {
            "fieldRef": {"fieldPath": "status.podIP"}}})  # fmt: skip
    env.append({"name": "HOME", "value": "/tmp"})  # the image's HOME is root's
    container["env"] = env
    container["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {
            "drop": ["ALL"],
            **({"add": list(TRAINER_CAPABILITIES)} if role == "trainer" else {}),
        },
    }
    spec["automountServiceAccountToken"] = False  # no Kubernetes API calls (IRSA has its own)
    spec["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": POD_UID,
        "runAsGroup": POD_UID,
        "fsGroup": POD_UID,  # the mounted volumes (output dir, init checkpoint) are writable
        **({"seccompProfile": {"type": "RuntimeDefault"}} if role == "trainer" else {}),
    }


def main(argv: list[str]) -> int:
    """`python -m slipstream.launch.torchx --queue Q [--service_account SA] -- <rl's args>`:
    the job's Secret, NetworkPolicy and Volcano Job (kubernetes_resources) as YAML documents on
    stdout, for `kubectl apply -f -`; a bad argument: one line on stderr, exit 2."""
    import yaml
    from torchx.specs.builders import materialize_appdef

    p = argparse.ArgumentParser(prog="python -m slipstream.launch.torchx", allow_abbrev=False)
    p.add_argument("--queue", required=True, help="the Volcano queue (torchx's -cfg queue=)")
    p.add_argument("--service_account", default="slipstream", help="pods' service account")
    p.add_argument("component_args", nargs=argparse.REMAINDER, help="rl's arguments")
    args = p.parse_args(argv)
    rest = args.component_args[1:] if args.component_args[:1] == ["--"] else args.component_args
    try:
        app = materialize_appdef(rl, rest)
        resources = kubernetes_resources(app, args.queue, args.service_account)
    except ValueError as e:  # JobArgumentError; TorchX's own argument errors
        print(f"{p.prog}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    yaml.safe_dump_all(resources, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
