"""Config and command line as hostile input: non-finite numbers in every float field of every
config section, config files that are not files, not UTF-8 or FIFOs, OS errors (a file as
output_dir, a missing checkpoint or model), and sandbox CLI options that used to end in
tracebacks. Every failure is one line (argparse's usage + error for bad options) and names the
key, value or path; normal commands still work afterwards."""

from __future__ import annotations

import importlib
import os
import shutil
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from slipstream.cli import main
from slipstream.config import ConfigError, SlipstreamConfig, load_config
from slipstream.config.base import Section

NON_FINITE = ["inf", "-inf", "nan"]
CONFIG_MODULES = ["slipstream.config", "slipstream.config.sweep", "slipstream.config.parallel",
                  "slipstream.plan.rates"]  # fmt: skip


def _sections() -> list[type[Section]]:
    for name in CONFIG_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
    found, todo = set(), [Section]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__name__}")


def _has_float(ann: object) -> bool:
    return ann is float or any(_has_float(a) for a in typing.get_args(ann))


def _bad_value(ann: object, x: float) -> object:
    """`x` in the shape the field takes: a float, a list of floats or of (int, float) pairs, a
    dict of floats."""
    origin = typing.get_origin(ann)
    if origin is list and typing.get_origin(typing.get_args(ann)[0]) is tuple:
        return [(1, 1.0), (2, x)]
    if origin is list:
        return [1.0, x]
    if origin is dict:
        return {"k": x}
    return x


FLOAT_FIELDS = [(cls, name, f.annotation) for cls in _sections()
                for name, f in cls.model_fields.items() if _has_float(f.annotation)]  # fmt: skip


def test_the_walk_finds_the_float_fields() -> None:
    names = {f"{c.__name__}.{n}" for c, n, _ in FLOAT_FIELDS}
    assert {"TrainerConfig.lr", "TrainerConfig.grad_clip", "SFTConfig.lr",
            "SandboxConfig.exec_timeout_s", "SweepConfig.densities",
            "RunConfig.ray_trainer_resources"} <= names  # fmt: skip
    assert len(FLOAT_FIELDS) >= 40


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("cls,name,ann", FLOAT_FIELDS,
                         ids=[f"{c.__name__}.{n}" for c, n, _ in FLOAT_FIELDS])  # fmt: skip
def test_every_float_field_refuses_non_finite(cls, name: str, ann: object, value: str) -> None:
    with pytest.raises(ValidationError) as info:
        cls.model_validate({name: _bad_value(ann, float(value))})
    errors = info.value.errors()
    assert errors and all(e["loc"][0] == name for e in errors), errors
    assert any(e["type"] == "finite_number" for e in errors), errors
    ok = cls()  # the defaults are finite and valid
    with pytest.raises(ValidationError):  # assignment is validated too
        setattr(ok, name, _bad_value(ann, float(value)))


JOB_FLOAT_KEYS = [f"{section}.{name}" for section, f in SlipstreamConfig.model_fields.items()
                  for name, sf in f.annotation.model_fields.items()
                  if _has_float(sf.annotation) and typing.get_origin(sf.annotation) is None]  # fmt: skip


@pytest.mark.parametrize("key", JOB_FLOAT_KEYS)
def test_job_config_overrides_and_files_name_the_key_and_value(key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}=inf"])
    assert f"{key} = inf: Input should be a finite number" in str(info.value)
    assert "command-line overrides" in str(info.value)
    section, name = key.split(".")
    toml = tmp_path / "bad.toml"
    toml.write_text(f"[{section}]\n{name} = nan\n")
    with pytest.raises(ConfigError) as info:
        load_config(toml)
    assert f"{key} = nan: Input should be a finite number" in str(info.value)
    assert str(toml) in str(info.value)


def test_cli_refuses_inf_lr_and_still_works(capsys) -> None:
    for value in ("inf", "nan", "1e999", "-inf"):
        assert main(["config", "show", f"--trainer.lr={value}"]) == 2
        err = capsys.readouterr().err
        assert "trainer.lr = " in err and "finite number" in err and "Traceback" not in err
    assert main(["config", "show", "--trainer.lr=3e-4"]) == 0
    assert "lr = 0.0003" in capsys.readouterr().out


def test_config_files_that_are_not_text_files(tmp_path: Path, capsys) -> None:
    (tmp_path / "latin1.toml").write_bytes(b"[run]\nname = '\xe9'\n")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # reading it would block forever: refused without opening
    cases = {tmp_path / "latin1.toml": "not UTF-8", tmp_path: "not a regular file",
             fifo: "not a regular file", tmp_path / "missing.toml": "does not exist"}  # fmt: skip
    for path, why in cases.items():
        with pytest.raises(ConfigError, match=why):
            load_config(path)
        assert main(["config", "show", "-c", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and why in err and str(path) in err, err
    (tmp_path / "ok.toml").write_text("[trainer]\nlr = 0.01\n")
    assert load_config(tmp_path / "ok.toml").trainer.lr == 0.01


def test_deeply_nested_toml_is_one_line_not_a_recursion_error(tmp_path: Path, capsys) -> None:
    """tomllib recurses once per level of an array or inline table: thousands of levels, in a
    file or an override, are a config error, not a RecursionError traceback."""
    deep = {"array": "[" * 5000 + "]" * 5000, "table": "{a = " * 5000 + "1" + "}" * 5000}
    for name, value in deep.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(f"[run]\nseed = {value}\n")
        assert main(["config", "show", "-c", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"slipstream: {path}: not usable TOML: nested too deeply", err
        assert main(["config", "show", f"--run.seed={value}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "nested too deeply" in err and len(err) < 300, err


# ---- OS errors: one line naming the path --------------------------------------------------


def _one_line(capsys, rc: int, expected_rc: tuple[int, ...] = (1,)) -> str:
    err = capsys.readouterr().err.strip()
    assert rc in expected_rc, err
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert err.startswith("slipstream"), err
    return err


@pytest.mark.parametrize("command", ["sft", "run"])
def test_existing_file_as_output_dir(tmp_path: Path, command: str, capsys) -> None:
    out = tmp_path / "taken"
    out.write_text("a file, not a directory")
    err = _one_line(capsys, main([command, f"--run.output_dir={out}"]))
    assert f"{out}: run.output_dir is not a directory" in err
    assert out.read_text() == "a file, not a directory"


def test_missing_eval_checkpoint_and_serve_model(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere"
    err = _one_line(capsys, main(["eval", "--checkpoint", str(missing)]))
    assert str(missing) in err
    err = _one_line(capsys, main(["serve", "--model", str(missing)]), expected_rc=(1, 2))
    assert str(missing) in err


@pytest.mark.parametrize("flag,value", [("--port", "99999"), ("--port", "0"),
                                        ("--max-batch-samples", "0"),
                                        ("--max-batch-samples", "65537"),
                                        ("--max-request-bytes", "100")])  # fmt: skip
def test_serve_numeric_flags_out_of_range_are_one_line(flag: str, value: str, tmp_path: Path,
                                                       capsys) -> None:  # fmt: skip
    """Issue 32: `serve --port 99999` ended in a traceback (after loading the model). (Negative,
    non-finite and huge values of every numeric flag are usage errors: test_config_bounds.)"""
    err = _one_line(capsys, main(["serve", "--model", str(tmp_path), flag, value]),
                    expected_rc=(2,))  # fmt: skip
    assert f"{flag} {int(value)}: must be in [" in err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e308"])
def test_plan_search_budget_out_of_range_is_a_usage_error(value: str, tmp_path: Path,
                                                         capsys) -> None:  # fmt: skip
    """Issue 32: `plan search --budget-per-hour nan` ended in a traceback. Nothing is written."""
    with pytest.raises(SystemExit) as info:
        main(["plan", "search", "-c", "configs/plan/p5en-48.toml", "--budget-per-hour", value,
              "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    assert "error: argument --budget-per-hour" in err.strip().split("\n")[-1], err
    assert not (tmp_path / "out").exists()


def test_plan_search_writes_under_runs_by_default_not_over_tracked_files(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Issue 32: the default output was the tracked benchmarks/plan-p5en-48/frontier.json."""
    config = Path("configs/plan/p5en-48.toml").resolve()
    tracked = Path("benchmarks/plan-p5en-48/frontier.json").resolve()
    before = tracked.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "search", "-c", str(config)]) == 0
    assert (tmp_path / "runs" / "plan-p5en-48" / "frontier.json").is_file()
    assert tracked.read_bytes() == before
    assert "runs/plan-p5en-48/frontier.json" in capsys.readouterr().out


def test_ckpt_export_errors(tmp_path: Path, capsys) -> None:
    import torch

    from slipstream.storage import WeightStore

    store = tmp_path / "store"
    err = _one_line(capsys, main(["ckpt", "export", f"--store.url={store}", "--version", "4",
                                  str(tmp_path / "out")]))  # fmt: skip
    assert f"no store at {store}" in err and not store.exists()
    store.mkdir()
    err = _one_line(capsys, main(["ckpt", "export", f"--store.url={store}", "--version", "4",
                                  str(tmp_path / "out")]))  # fmt: skip
    assert "weights/v00000004/manifest.json: no manifest (not published)" in err
    WeightStore(str(store)).publish(4, {"w": torch.ones(2)})
    (tmp_path / "file").write_text("x")
    err = _one_line(
        capsys, main(["ckpt", "export", f"--store.url={store}", str(tmp_path / "file")])
    )
    assert str(tmp_path / "file") in err
    assert main(["ckpt", "export", f"--store.url={store}", str(tmp_path / "out")]) == 0


def test_ckpt_list_on_a_missing_output_dir_creates_nothing(tmp_path: Path, capsys) -> None:
    """A read-only command: a mistyped --run.output_dir (or store.url) is one line naming the
    directory, and no run tree is left behind."""
    missing = tmp_path / "typo" / "run"
    for url_args in ([f"--run.output_dir={missing}"], [f"--store.url=file://{missing}/store"]):
        err = _one_line(capsys, main(["ckpt", "list", *url_args]))
        assert f"no store at {missing}/store" in err
        assert not (tmp_path / "typo").exists()
    (missing / "store").mkdir(parents=True)  # an empty store lists nothing, rc 0
    assert main(["ckpt", "list", f"--run.output_dir={missing}"]) == 0
    assert '"weight_versions": []' in capsys.readouterr().out


def test_traceback_on_request(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "taken"
    out.write_text("x")
    monkeypatch.setenv("SLIPSTREAM_TRACEBACK", "1")
    with pytest.raises(NotADirectoryError):
        main(["sft", f"--run.output_dir={out}"])


# ---- sandbox CLI options ------------------------------------------------------------------

BAD_OPTIONS = {
    "unknown backend": ["run", "--backend", "nope", "--", "true"],
    "memory too small": ["run", "--memory-mib", "1", "--", "true"],
    "memory not a number": ["run", "--memory-mib", "lots", "--", "true"],
    "timeout nan": ["run", "--timeout", "nan", "--", "true"],
    "timeout inf": ["run", "--timeout", "inf", "--", "true"],
    "timeout negative": ["run", "--timeout", "-1", "--", "true"],
    "timeout zero": ["run", "--timeout", "0", "--", "true"],
    "no execs": ["pool", "--execs", "0"],
    "negative concurrency": ["pool", "--concurrency", "-3"],
    "zero concurrency": ["pool", "--concurrency", "0"],
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_sandbox_options_are_usage_errors(case: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sandbox", *BAD_OPTIONS[case]])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("slipstream sandbox "), err
    assert "error: argument" in err


@pytest.mark.parametrize("override,why", [
    ("--sandbox.memory_mib=8", "sandbox.memory_mib = 8"),
    ("--sandbox.exec_timeout_s=inf", "sandbox.exec_timeout_s = inf"),
    ("--sandbox.backend=docker", "sandbox.backend = 'docker'"),
])  # fmt: skip
def test_bad_sandbox_settings_are_config_errors(override: str, why: str, capsys) -> None:
    assert main(["sandbox", "run", override, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream: invalid config") and why in err, err
    assert "Traceback" not in err


def test_template_errors_name_the_field() -> None:
    from slipstream.sandbox.base import SandboxTemplate

    with pytest.raises(ValueError, match="sandbox memory_mib = 1: must be an integer >= 16"):
        SandboxTemplate(memory_mib=1)
    with pytest.raises(ValueError, match="sandbox exec_timeout_s = nan"):
        SandboxTemplate(exec_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="sandbox pids_max = 2"):
        SandboxTemplate(pids_max=2)


def test_sandbox_backend_names_agree() -> None:
    from slipstream.cli.sandbox import BACKENDS
    from slipstream.sandbox.base import BACKEND_NAMES

    assert BACKENDS == BACKEND_NAMES


@pytest.mark.skipif(shutil.which("firecracker") is not None, reason="firecracker is installed")
def test_unavailable_backend_and_bad_dirs_are_one_line(tmp_path: Path, capsys) -> None:
    err = _one_line(capsys, main(["sandbox", "run", "--backend", "firecracker", "--", "true"]))
    assert err.startswith("slipstream sandbox: firecracker:")
    err = _one_line(capsys, main(["sandbox", "reap", "--sandbox.state_dir=/proc/no/such"]))
    assert "/proc/no" in err
    err = _one_line(capsys, main(["sandbox", "build-image", "--cache-dir", "/proc/no/such"]))
    assert "/proc/no" in err or "slipstream sandbox:" in err
    # normal operation afterwards
    assert main(["sandbox", "run", "--backend", "process", f"--sandbox.state_dir={tmp_path}",
                 "--", "echo", "ok"]) == 0  # fmt: skip
    assert capsys.readouterr().out == "ok\n"
