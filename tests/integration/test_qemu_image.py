"""Guest image builder: the initramfs holds what /init needs, the cache is reused while the inputs
are unchanged, and a changed input gives a different image key. No VM is booted here."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess

import pytest

from slipstream.sandbox import image as im

pytestmark = pytest.mark.skipif(
    shutil.which("busybox") is None and not im.Path("/bin/busybox").exists(),
    reason="needs busybox-static",
)


@pytest.fixture(scope="module")
def built():
    return im.build_image()


def test_initramfs_contents(built):
    assert shutil.which("cpio"), "cpio is installed by scripts/setup.sh"
    listing = subprocess.run(["cpio", "-it", "--quiet"], input=gzip.decompress(built.initramfs.read_bytes()),
                             capture_output=True, check=True).stdout.decode().split()  # fmt: skip
    manifest = json.loads(built.manifest.read_text())
    version = manifest["python_version"]
    for path in ("init", "etc/inittab", "sbin/slipstream-agent", "bin/busybox", "bin/sh", "sbin/init",
                 f"usr/bin/python{version}", "usr/bin/python3", manifest["stdlib_zip"].lstrip("/"),
                 im.GUEST_AGENT_PATH.lstrip("/"), "lib/modules/virtio_console.ko",
                 "lib/modules/vmw_vsock_virtio_transport.ko", "lib/modules/virtio_mmio.ko",
                 "lib64/ld-linux-x86-64.so.2"):  # fmt: skip
        assert path in listing, path
    # modules are loaded dependencies first
    order = manifest["kernel_modules"]
    assert order.index("virtio.ko") < order.index("virtio_console.ko")
    assert order.index("vsock.ko") < order.index("vmw_vsock_virtio_transport.ko")
    assert manifest["initramfs_bytes"] == built.initramfs.stat().st_size


def test_cache_hit_and_input_change(built, monkeypatch):
    mtime = built.manifest.stat().st_mtime_ns
    again = im.build_image()
    assert again == built and again.manifest.stat().st_mtime_ns == mtime  # not rebuilt
    # The inputs as build_image saw them: from the same cache (on a machine without a cloud
    # kernel in /boot, the kernel was downloaded into it; another root would download it again,
    # to another path, and hash differently).
    inputs = im._inputs(built.kernel.parent.parent)
    key = im._input_hash(inputs)
    assert key == built.kernel.parent.name
    monkeypatch.setattr(im, "INIT_SCRIPT", im.INIT_SCRIPT + "# changed\n")
    assert im._input_hash(inputs) != key


def test_cpio_writer_roundtrip(tmp_path):
    c = im._Cpio()
    c.file("a/b/c.txt", b"hello", 0o600)
    c.symlink("a/link", "b/c.txt")
    raw = c.finish()
    (tmp_path / "x").mkdir()
    subprocess.run(["cpio", "-idm", "--quiet"], input=raw, cwd=tmp_path / "x", check=True)
    assert (tmp_path / "x/a/b/c.txt").read_bytes() == b"hello"
    assert (tmp_path / "x/a/link").read_text() == "hello"
    assert oct((tmp_path / "x/a/b/c.txt").stat().st_mode & 0o777) == "0o600"


def test_module_load_order_rejects_unknown_module(built):
    kernel, modules_dir = im.find_kernel(built.kernel.parent.parent)
    with pytest.raises(RuntimeError, match="no_such_module"):
        im.module_load_order(modules_dir, ("no_such_module",))
