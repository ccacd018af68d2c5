"""Contract tests for the Firecracker backend (no Firecracker binary is needed).

A fake Firecracker API server (a real HTTP/1.1 server on a Unix socket, in a thread) checks every
request the client sends against the Firecracker 1.17 OpenAPI spec: the path and method must exist,
path parameters must match, the body must validate against the body schema ($refs resolved,
read-only fields refused) and, like Firecracker itself (serde `deny_unknown_fields`), unknown
fields are refused. It also keeps Firecracker's state rules that the spec only states in prose:
pre-boot calls after InstanceStart and InstanceStart without a boot source are errors.

The spec comes from `../shared/reference/` beside the repository when present, else from the
vendored copy in tests/data (Apache-2.0, unchanged).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import yaml
from openapi_schema_validator import OAS30ReadValidator, OAS30WriteValidator

from slipstream.sandbox import firecracker as fc
from slipstream.sandbox.agent_client import agent_source_path
from slipstream.sandbox.errors import SandboxBroken
from slipstream.sandbox.firecracker_api import FirecrackerAPI, FirecrackerAPIError

REPO = Path(__file__).resolve().parents[2]
SPEC_NAME = "firecracker-api-1.17.0-dev.yaml"
SHARED_SPEC = REPO.parent / "shared" / "reference" / SPEC_NAME
VENDORED_SPEC = REPO / "tests" / "data" / SPEC_NAME
PRE_BOOT = {
    "/boot-source",
    "/machine-config",
    "/vsock",
    "/entropy",
    "/serial",
    "/logger",
    "/metrics",
}


def load_spec() -> dict:
    path = SHARED_SPEC if SHARED_SPEC.exists() else VENDORED_SPEC
    return yaml.safe_load(path.read_text())


def strict(schema: object) -> object:
    """Objects with declared properties refuse undeclared ones (as Firecracker's parser does)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


class Contract:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.defs = strict(copy.deepcopy(spec["definitions"]))
        self.routes = []
        for template, item in spec["paths"].items():
            pattern = "^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", template) + "$"
            self.routes.append((re.compile(pattern), template, item))

    def schema(self, s: dict) -> dict:
        return {**s, "definitions": self.defs}

    def check_request(self, method: str, path: str, body: object) -> list[str]:
        found = [(p.match(path), t, i) for p, t, i in self.routes if p.match(path)]
        if not found:
            return [f"no path {path!r} in the spec"]
        m, template, item = found[0]
        op = item.get(method.lower())
        if op is None:
            return [f"{method} not allowed on {template}"]
        errors = []
        for param in op.get("parameters", []):
            if param["in"] == "path" and not m.group(param["name"]):
                errors.append(f"path parameter {param['name']} is empty")
            if param["in"] == "body":
                if body is None:
                    if param.get("required"):
                        errors.append(f"{method} {template}: missing required body")
                    continue
                v = OAS30WriteValidator(self.schema(param["schema"]))
                errors += [
                    f"{method} {template}: {e.message} at {list(e.path)}"
                    for e in v.iter_errors(body)
                ]
        if template == "/drives/{drive_id}" and isinstance(body, dict):
            if body.get("drive_id") != m.group("drive_id"):
                errors.append("drive_id in the body differs from the path")
        return errors

    def check_response(self, template: str, method: str, status: int, body: object) -> list[str]:
        responses = self.spec["paths"][template][method.lower()]["responses"]
        resp = responses.get(status, responses.get("default"))
        if resp is None or "schema" not in resp:
            return [] if body is None else [f"{template}: status {status} has no body in the spec"]
        v = OAS30ReadValidator(self.schema(resp["schema"]))
        return [f"response {template}: {e.message}" for e in v.iter_errors(body)]


class FakeFirecracker:
    """Answers like Firecracker, records (method, path, body) and every contract violation."""

    def __init__(self, sock_path: Path, contract: Contract) -> None:
        self.contract = contract
        self.requests: list[tuple[str, str, object]] = []
        self.violations: list[str] = []
        self.state = "Not started"
        self.configured: set[str] = set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                status, reply = fake.handle(self.command, self.path, body)
                data = json.dumps(reply).encode() if reply is not None else b""
                self.send_response(status)
                if data:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_PATCH = _handle

        self.server = socketserver.ThreadingUnixStreamServer(str(sock_path), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, method: str, path: str, body: object) -> tuple[int, object]:
        self.requests.append((method, path, body))
        errors = self.contract.check_request(method, path, body)
        if not errors and method == "PUT" and path in PRE_BOOT and self.state != "Not started":
            errors = [f"{path} is pre-boot only"]
        if not errors and path == "/actions" and body["action_type"] == "InstanceStart":
            if "/boot-source" not in self.configured:
                errors = ["InstanceStart without a boot source"]
            else:
                self.state = "Running"
        if errors:
            self.violations += errors
            return 400, {"fault_message": "; ".join(errors)}
        self.configured.add(path)
        if method == "GET" and path == "/":
            reply = {"app_name": "Firecracker", "id": "anonymous-instance", "state": self.state,
                     "vmm_version": "1.17.0-dev"}  # fmt: skip
            self.violations += self.contract.check_response("/", "GET", 200, reply)
            return 200, reply
        if method == "GET" and path == "/version":
            return 200, {"firecracker_version": "1.17.0-dev"}
        return 204, None


@pytest.fixture(scope="module")
def contract() -> Contract:
    return Contract(load_spec())


@pytest.fixture
def fake(tmp_path, contract):
    f = FakeFirecracker(tmp_path / "api.sock", contract)
    yield f
    f.close()


def run(coro):
    return asyncio.run(coro)


def test_vendored_spec_matches_shared():
    assert VENDORED_SPEC.exists()
    if SHARED_SPEC.exists():
        assert VENDORED_SPEC.read_bytes() == SHARED_SPEC.read_bytes()
    assert "Apache" in VENDORED_SPEC.read_text()[:1000]


def test_boot_sequence_validates_against_spec(fake, tmp_path):
    async def go():
        async with FirecrackerAPI(str(tmp_path / "api.sock")) as api:
            info = await api.wait_ready(2.0)
            assert info["state"] == "Not started"
            await fc.boot_sequence(api, vcpus=2, memory_mib=256)
            assert (await api.describe_instance())["state"] == "Running"

    run(go())
    assert fake.violations == []
    paths = [p for _, p, _ in fake.requests]
    assert paths == ["/", "/logger", "/metrics", "/serial", "/boot-source", "/machine-config",
                     "/vsock", "/entropy", "/actions", "/"]  # fmt: skip
    bodies = {p: b for _, p, b in fake.requests}
    assert bodies["/boot-source"]["initrd_path"] == fc.JAIL_INITRD
    assert f"slipstream.ctl=vsock:{fc.AGENT_VSOCK_PORT}" in bodies["/boot-source"]["boot_args"]
    assert bodies["/machine-config"] == {"vcpu_count": 2, "mem_size_mib": 256, "smt": False,
                                         "track_dirty_pages": False}  # fmt: skip
    assert bodies["/vsock"] == {"guest_cid": fc.GUEST_CID, "uds_path": fc.JAIL_VSOCK}


def test_every_other_client_call_validates(fake, tmp_path):
    async def go():
        async with FirecrackerAPI(str(tmp_path / "api.sock")) as api:
            assert await api.version() == "1.17.0-dev"
            await api.put_drive(
                "scratch", "/scratch.ext4", is_root_device=False, is_read_only=False
            )
            await api.put_boot_source("/vmlinux")
            await api.put_machine_config(1, 128, track_dirty_pages=True, huge_pages="None")
            await api.start()
            await api.pause()
            await api.create_snapshot("/snap", "/mem")
            await api.create_snapshot("/snap2", "/mem2", diff=True)
            await api.resume()
            await api.flush_metrics()
            await api.send_ctrl_alt_del()
            await api.load_snapshot("/snap", "/mem")

    run(go())
    assert fake.violations == []
    assert len(fake.requests) == 12


def test_contract_violations_are_refused_and_reported(fake, tmp_path):
    """The fake is not a rubber stamp: bad bodies, unknown fields, wrong order all fail."""

    async def go():
        async with FirecrackerAPI(str(tmp_path / "api.sock")) as api:
            with pytest.raises(FirecrackerAPIError, match="InstanceStart without a boot source"):
                await api.start()
            with pytest.raises(FirecrackerAPIError, match="less than the minimum"):
                await api.put_machine_config(vcpu_count=0, mem_size_mib=128)
            with pytest.raises(FirecrackerAPIError, match="Additional properties"):
                await api._call("PUT", "/vsock", {"guest_cid": 3, "uds_path": "/v", "bogus": 1})
            with pytest.raises(FirecrackerAPIError, match="no path") as e:
                await api._call("PUT", "/nope", {})
            assert e.value.status == 400 and e.value.method == "PUT"

    run(go())
    assert len(fake.violations) == 4


def test_unreachable_socket_is_a_clear_error(tmp_path):
    async def go():
        async with FirecrackerAPI(str(tmp_path / "missing.sock")) as api:
            with pytest.raises(FirecrackerAPIError, match="HTTP None"):
                await api.wait_ready(0.05)

    run(go())


def test_jailer_argv_pins_cpus_and_numa_nodes(tmp_path):
    argv = fc.jailer_argv(vm_id="sb-1", firecracker="/usr/bin/firecracker", jailer="/usr/bin/jailer",
                          uid=123, gid=124, chroot_base=tmp_path, cgroup_version=2, memory_mib=256,
                          cpus=(2, 3), mems=(1,))  # fmt: skip
    assert argv[:5] == ["/usr/bin/jailer", "--id", "sb-1", "--exec-file", "/usr/bin/firecracker"]
    cgroups = [argv[i + 1] for i, a in enumerate(argv) if a == "--cgroup"]
    assert cgroups == [
        f"memory.max={(256 + fc.VMM_OVERHEAD_MIB) << 20}",
        "cpuset.cpus=2-3",
        "cpuset.mems=1",
    ]
    assert argv[argv.index("--cgroup-version") + 1] == "2"
    assert argv[-3:] == ["--", "--api-sock", fc.JAIL_API]
    v1 = fc.jailer_argv(vm_id="x", firecracker="f", jailer="j", uid=1, gid=1, chroot_base=tmp_path,
                        cgroup_version=1, memory_mib=64, cpus=None, mems=None)  # fmt: skip
    assert [a for a in v1 if a.startswith(("cpuset", "memory"))] == [
        f"memory.limit_in_bytes={(64 + fc.VMM_OVERHEAD_MIB) << 20}"
    ]
    assert fc.jailer_cgroup_dirs("x", 2) == [f"/sys/fs/cgroup/{fc.PARENT_CGROUP}/x"]


class FakeVsockMux:
    """Firecracker's host-side vsock socket: `CONNECT <port>\\n` -> `OK <n>\\n`, then the stream is
    the guest's. The first `refuse` connections are dropped (the guest agent is not listening
    yet); then the real guest agent serves the accepted connection on its stdio."""

    def __init__(self, path: Path, workdir: Path, refuse: int) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.workdir, self.refuse = workdir, refuse
        self.lines: list[bytes] = []
        self.agent: subprocess.Popen | None = None
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            line = conn.makefile("rb").readline()
            self.lines.append(line)
            if self.refuse > 0 or line != f"CONNECT {fc.AGENT_VSOCK_PORT}\n".encode():
                self.refuse -= 1
                conn.close()
                continue
            conn.sendall(b"OK 1073741824\n")
            self.agent = subprocess.Popen([sys.executable, agent_source_path(), "--workdir", str(self.workdir)],
                                          stdin=conn.fileno(), stdout=conn.fileno())  # fmt: skip
            conn.close()
            return

    def close(self) -> None:
        self.listener.close()
        if self.agent is not None:
            self.agent.kill()
            self.agent.wait()


def test_vsock_connect_handshake_with_the_real_agent(tmp_path):
    mux = FakeVsockMux(tmp_path / "v.sock", tmp_path, refuse=2)

    async def go():
        conn = await fc.vsock_connect(tmp_path / "v.sock", fc.AGENT_VSOCK_PORT, timeout_s=20)
        hello = await conn.wait_hello(20)
        r = await conn.exec(["sh", "-c", "echo over-vsock"], timeout_s=20)
        await conn.close()
        return hello, r

    try:
        hello, r = run(go())
    finally:
        mux.close()
    assert hello["type"] == "hello" and r.stdout == b"over-vsock\n" and r.exit_code == 0
    assert mux.lines == [f"CONNECT {fc.AGENT_VSOCK_PORT}\n".encode()] * 3


def test_vsock_connect_times_out_with_a_reason(tmp_path):
    with pytest.raises(SandboxBroken, match="FileNotFoundError"):
        run(fc.vsock_connect(tmp_path / "absent.sock", 52, timeout_s=0.2))


@pytest.mark.skipif(not list(Path("/boot").glob("vmlinuz-*")) or shutil.which("lz4") is None,
                    reason="needs a host kernel in /boot and lz4")  # fmt: skip
def test_extract_vmlinux_from_the_host_kernel():
    bzimage = sorted(Path("/boot").glob("vmlinuz-*"))[-1].read_bytes()
    elf = fc.extract_vmlinux(bzimage)
    assert elf[:4] == b"\x7fELF" and elf[4] == 2  # 64-bit ELF
    with pytest.raises(RuntimeError, match="not a bzImage"):
        fc.extract_vmlinux(b"\0" * 4096)


def test_probe_says_why_not():
    ok, reason = fc.probe()
    if shutil.which("firecracker") is None:
        assert not ok and "contract-tested" in reason


@pytest.mark.skipif(shutil.which("firecracker") is not None, reason="firecracker is installed here")
def test_backend_refuses_cleanly_without_binaries(tmp_path):
    from slipstream.sandbox.base import SandboxTemplate, make_backend
    from slipstream.sandbox.errors import BackendUnavailable

    backend = make_backend("firecracker", state_dir=tmp_path)
    with pytest.raises(BackendUnavailable, match="contract-tested"):
        run(backend.create(SandboxTemplate(backend="firecracker"), sandbox_id="fc-x"))
    assert not (tmp_path / "jailer").exists()
