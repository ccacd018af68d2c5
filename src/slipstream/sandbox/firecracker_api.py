"""Async client for Firecracker's REST API over its Unix socket (httpx with a UDS transport).

Covers what a sandbox needs: GET / (instance info) and /version, PUT /logger, /metrics,
/boot-source, /machine-config, /drives/{id}, /vsock, /serial, /entropy, /actions (InstanceStart,
SendCtrlAltDel, FlushMetrics), PATCH /vm (pause/resume), PUT /snapshot/create and /snapshot/load.
Bodies follow the Firecracker 1.17 OpenAPI spec; `tests/unit/test_firecracker_api.py` checks every
request this client sends against that spec with a fake server (no Firecracker binary is needed).

Errors: a non-2xx answer raises `FirecrackerAPIError` carrying the method, path, HTTP status and
Firecracker's `fault_message`. Not covered: network interfaces, MMDS, balloon, memory hotplug, CPU
templates, PCI, pmem (sandboxes use none of them).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx


class FirecrackerAPIError(RuntimeError):
    """Firecracker refused a request (or the socket did not answer)."""

    def __init__(self, method: str, path: str, status: int | None, fault: str) -> None:
        super().__init__(f"Firecracker {method} {path}: HTTP {status}: {fault}")
        self.method, self.path, self.status, self.fault = method, path, status, fault


def _drop_none(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


class FirecrackerAPI:
    """One Firecracker process's API socket. Use `async with` or call `aclose()`."""

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self.socket_path = str(socket_path)
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket_path),
            base_url="http://localhost",
            timeout=timeout_s,
        )

    async def __aenter__(self) -> FirecrackerAPI:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            resp = await self._client.request(method, path, json=body)
        except httpx.TransportError as e:
            raise FirecrackerAPIError(method, path, None, f"{type(e).__name__}: {e}") from None
        if resp.status_code >= 300:
            try:
                fault = resp.json().get("fault_message", resp.text)
            except ValueError:
                fault = resp.text
            raise FirecrackerAPIError(method, path, resp.status_code, fault)
        return resp.json() if resp.content else None

    async def wait_ready(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Poll GET / until the socket answers (Firecracker creates it a few ms after start)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.describe_instance()
            except FirecrackerAPIError as e:
                if e.status is not None or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.005)

    # ------------------------------------------------------------------------------ read-only

    async def describe_instance(self) -> dict[str, Any]:
        """GET /: {app_name, id, state ("Not started" | "Running" | "Paused"), vmm_version}."""
        return await self._call("GET", "/")

    async def version(self) -> str:
        return (await self._call("GET", "/version"))["firecracker_version"]

    # ------------------------------------------------------------------------------ pre-boot

    async def put_logger(self, log_path: str, level: str = "Warning", show_level: bool = True,
                         show_log_origin: bool = False) -> None:  # fmt: skip
        await self._call("PUT", "/logger", {"log_path": log_path, "level": level,
                                            "show_level": show_level, "show_log_origin": show_log_origin})  # fmt: skip

    async def put_metrics(self, metrics_path: str) -> None:
        await self._call("PUT", "/metrics", {"metrics_path": metrics_path})

    async def put_boot_source(self, kernel_image_path: str, initrd_path: str | None = None,
                              boot_args: str | None = None) -> None:  # fmt: skip
        body = {
            "kernel_image_path": kernel_image_path,
            "initrd_path": initrd_path,
            "boot_args": boot_args,
        }
        await self._call("PUT", "/boot-source", _drop_none(body))

    async def put_machine_config(self, vcpu_count: int, mem_size_mib: int, smt: bool = False,
                                 track_dirty_pages: bool = False, huge_pages: str | None = None) -> None:  # fmt: skip
        body = {"vcpu_count": vcpu_count, "mem_size_mib": mem_size_mib, "smt": smt,
                "track_dirty_pages": track_dirty_pages, "huge_pages": huge_pages}  # fmt: skip
        await self._call("PUT", "/machine-config", _drop_none(body))

    async def put_drive(self, drive_id: str, path_on_host: str, is_root_device: bool = False,
                        is_read_only: bool = True) -> None:  # fmt: skip
        body = {"drive_id": drive_id, "path_on_host": path_on_host,
                "is_root_device": is_root_device, "is_read_only": is_read_only}  # fmt: skip
        await self._call("PUT", f"/drives/{drive_id}", body)

    async def put_vsock(self, guest_cid: int, uds_path: str) -> None:
        """Host-initiated connections: connect to `uds_path`, send `CONNECT <port>\\n`."""
        await self._call("PUT", "/vsock", {"guest_cid": guest_cid, "uds_path": uds_path})

    async def put_serial(self, serial_out_path: str) -> None:
        await self._call("PUT", "/serial", {"serial_out_path": serial_out_path})

    async def put_entropy(self) -> None:
        """A virtio-rng device (the guest then needs no RDRAND trust to seed its RNG)."""
        await self._call("PUT", "/entropy", {})

    # ------------------------------------------------------------------------------ actions

    async def _action(self, action_type: str) -> None:
        await self._call("PUT", "/actions", {"action_type": action_type})

    async def start(self) -> None:
        await self._action("InstanceStart")

    async def send_ctrl_alt_del(self) -> None:
        await self._action("SendCtrlAltDel")

    async def flush_metrics(self) -> None:
        await self._action("FlushMetrics")

    async def pause(self) -> None:
        await self._call("PATCH", "/vm", {"state": "Paused"})

    async def resume(self) -> None:
        await self._call("PATCH", "/vm", {"state": "Resumed"})

    # ------------------------------------------------------------------------------ snapshots

    async def create_snapshot(
        self, snapshot_path: str, mem_file_path: str, diff: bool = False
    ) -> None:
        """The VM must be paused first."""
        await self._call("PUT", "/snapshot/create", {"snapshot_path": snapshot_path,
                                                     "mem_file_path": mem_file_path,
                                                     "snapshot_type": "Diff" if diff else "Full"})  # fmt: skip

    async def load_snapshot(
        self, snapshot_path: str, mem_file_path: str, resume_vm: bool = True
    ) -> None:
        """On a fresh Firecracker process only (before any pre-boot call but logger/metrics)."""
        body = {"snapshot_path": snapshot_path, "resume_vm": resume_vm,
                "mem_backend": {"backend_type": "File", "backend_path": mem_file_path}}  # fmt: skip
        await self._call("PUT", "/snapshot/load", body)
