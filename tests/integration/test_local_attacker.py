"""A second local user against the runtime state we act on (issue 32, findings 1 and 2).

The other user is simulated the two ways a real one would get there first: a directory made in
advance and handed to uid nobody (chown, as root), and files planted into a directory we then
use. Each attack must be refused or ignored, and the victims (a live process, a directory of
the user's files) must be untouched afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from tests.sandboxutil import needs_bwrap

from slipstream.cli import main
from slipstream.rundir import UnsafeDirError, private_dir, runtime_root
from slipstream.sandbox.journal import Journal, SandboxRecord, default_state_dir, reap_record

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def victim(tmp_path):
    """A live process and a directory with a file in it: what a planted record names."""
    proc = subprocess.Popen(["sleep", "600"])
    d = tmp_path / "victim-files"
    d.mkdir()
    (d / "precious").write_text("keep me")
    yield proc, d
    proc.kill()
    proc.wait()


@pytest.fixture
def public_tmp():
    """A directory the other user (nobody) can reach: pytest's tmp_path is under a 0700 dir."""
    d = tempfile.mkdtemp(prefix="slipstream-local-attacker-", dir="/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d)


def planted_record(proc: subprocess.Popen, d, **extra) -> dict:
    from slipstream.sandbox.journal import process_start_ticks

    return {"owner_pid": 999_999_999, "owner_start": 1, "sandbox_id": "planted",
            "backend": "process", "pid": proc.pid, "pid_start_ticks": process_start_ticks(proc.pid),
            "cgroup_paths": [], "dirs": [str(d)], "extra": {}, **extra}  # fmt: skip


def assert_untouched(victim) -> None:
    proc, d = victim
    assert proc.poll() is None, "the victim process was killed"
    assert (d / "precious").read_text() == "keep me"


def test_default_state_dir_is_not_a_shared_tmp_name():
    assert not str(default_state_dir()).startswith("/tmp/")
    assert default_state_dir().parent == runtime_root()
    if os.geteuid() == 0:
        assert runtime_root() == runtime_root().__class__("/run/slipstream")


@needs_root
def test_state_dir_made_first_by_another_user_is_refused(tmp_path, victim, capsys):
    state = tmp_path / "squatted"
    (state / "journal").mkdir(parents=True)
    (state / "journal" / "planted.json").write_text(json.dumps(planted_record(*victim)))
    os.chown(state / "journal" / "planted.json", NOBODY, NOBODY)
    os.chown(state / "journal", NOBODY, NOBODY)
    os.chown(state, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirError, match=f"{state}.*owned by uid {NOBODY}"):
        Journal(state)
    # the CLI a root cron job would run: one line, rc 1, nothing reaped
    capsys.readouterr()
    assert main(["sandbox", "reap", f"--sandbox.state_dir={state}"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"owned by uid {NOBODY}" in err, err
    assert_untouched(victim)


def test_group_writable_or_symlinked_state_dir_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(UnsafeDirError, match="writable by group or others"):
        Journal(loose)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeDirError, match="symbolic link"):
        Journal(tmp_path / "link")
    # a journal dir swapped for a link to a directory of ours is refused too, not followed
    state = tmp_path / "state"
    state.mkdir()
    (state / "journal").symlink_to(real)
    with pytest.raises(UnsafeDirError, match="journal is a symbolic link"):
        Journal(state)


@needs_root
def test_ancestor_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirError, match=f"ancestor {theirs} is owned by uid {NOBODY}"):
        private_dir(theirs / "mine")


def test_planted_record_in_our_own_journal_is_ignored_and_removed(tmp_path, victim):
    journal = Journal(tmp_path)
    fd = os.open(journal.dir / "planted.json", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, json.dumps(planted_record(*victim)).encode())
    os.close(fd)
    forged = planted_record(*victim, sandbox_id="forged", mac="0" * 64)
    (journal.dir / "forged.json").write_text(json.dumps(forged))
    assert journal.reap_orphans(lambda _: reap_record) == 0
    assert_untouched(victim)
    assert not (journal.dir / "planted.json").exists()
    assert not (journal.dir / "forged.json").exists()
    # what our own journal writes is still reaped: the check does not disable crash recovery
    proc, d = victim
    journal.write(SandboxRecord(sandbox_id="ours", backend="process", dirs=[str(d)]))
    other = Journal(tmp_path)  # a later process: same key, another owner
    other.owner_pid, other.owner_start = 1, -1
    assert [e["sandbox_id"] for e in other.entries()] == ["ours"]


@needs_root
def test_planted_record_of_another_user_is_ignored(public_tmp, victim):
    """`setpriv --reuid=nobody` writes a record into a journal dir left writable to it: the dir is
    refused outright; made private again, the record (not ours, no MAC) is ignored."""
    journal = Journal(public_tmp)
    os.chmod(journal.dir, 0o777)
    body = json.dumps(planted_record(*victim))
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    "sh", "-c", f"cat > {journal.dir}/planted.json"], input=body, text=True,
                   check=True, timeout=30)  # fmt: skip
    assert (journal.dir / "planted.json").stat().st_uid == NOBODY
    with pytest.raises(UnsafeDirError, match="writable by group or others"):
        Journal(public_tmp)
    os.chmod(journal.dir, 0o700)
    assert Journal(public_tmp).reap_orphans(lambda _: reap_record) == 0
    assert_untouched(victim)


@needs_bwrap
def test_squatted_rootfs_cache_is_restaged_and_a_foreign_cache_refused(public_tmp):
    from slipstream.sandbox.agent_client import agent_source_path
    from slipstream.sandbox.base import SandboxTemplate
    from slipstream.sandbox.bwrap import BwrapBackend, rootfs_entries, tree_digest
    from slipstream.sandbox.errors import BackendUnavailable

    cache = public_tmp / "rootfs-cache"
    cache.mkdir(mode=0o755)
    # the attacker knows the key (a hash of public source) and stages a forged agent under it
    agent = open(agent_source_path(), "rb").read()
    name = f"rootfs-{tree_digest(rootfs_entries(agent))[:16]}"
    forged = cache / name
    (forged / "etc").mkdir(parents=True)
    (forged / "ready").write_text("")
    (forged / "agent.py").write_text("print('PWNED')\n")
    backend = BwrapBackend(state_dir=public_tmp / "state", rootfs_cache=cache)
    assert backend.rootfs == forged
    assert (forged / "agent.py").read_bytes() == agent
    assert not (forged / "ready").exists()

    async def run() -> tuple[int, bytes]:
        tmpl = SandboxTemplate(backend="bwrap", memory_mib=128, pids_max=64, workdir_mib=16)
        sb = await backend.create(tmpl, sandbox_id=f"la-{os.getpid()}")
        try:
            r = await sb.exec(["sh", "-c", "echo hi; exit 3"], timeout_s=30)
            return r.exit_code, r.stdout
        finally:
            await sb.release()

    assert asyncio.run(run()) == (3, "hi\n")
    # a cache directory another user made first is not used at all
    os.chown(cache, NOBODY, NOBODY)
    with pytest.raises(BackendUnavailable, match=f"{cache}.*owned by uid {NOBODY}"):
        BwrapBackend(state_dir=public_tmp / "state", rootfs_cache=cache)


@needs_root
def test_host_agent_refuses_a_state_dir_made_first_by_another_user(tmp_path):
    """The agent's flock file and journal live in its state dir: one made by uid nobody is
    refused before anything is created in it (the lock file was opened following links)."""
    import sys

    state = tmp_path / "agent-state"
    state.mkdir()
    os.chown(state, NOBODY, NOBODY)
    code = ("from slipstream.cli import main; raise SystemExit(main(['sandbox', 'serve', "
            f"'--socket', '{tmp_path}/agent.sock', '--sandbox.state_dir={state}', "
            "'--sandbox.backend=process', '--sandbox.min_idle=0']))")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr and f"owned by uid {NOBODY}" in r.stderr, r.stderr
    assert list(state.iterdir()) == [] and not (tmp_path / "agent.sock").exists()
