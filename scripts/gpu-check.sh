#!/usr/bin/env bash
# One prepared check of slipstream's CUDA paths on a bare GPU machine (docs/gpu.md).
#
#   bash scripts/gpu-check.sh OUT_DIR             # on the CUDA machine: the check itself
#   bash scripts/gpu-check.sh --dry-run [OUT_DIR] # anywhere, no GPU: is everything ready for it?
#   bash scripts/gpu-check.sh --rehearse OUT_DIR  # no GPU: every phase on this CPU (the script's
#                                                 # plumbing, not the GPU: tests skip, tiny bench)
#
# Full check, for a machine with CUDA, Python 3.12 + torch (CUDA build), transformers,
# safetensors, fsspec, httpx, rich, pytest, but no pydantic / FastAPI / uvicorn and no network:
#   1. install: the wheels of .wheelhouse/ (made by scripts/gpu-wheels.sh where PyPI is
#      reachable, carried along) go to a --target directory; the project runs from src/ on
#      PYTHONPATH (no build step, nothing of the machine's own Python is changed)
#   2. gpu-tests:  pytest -m "gpu and not slow" tests/gpu   (engine, trainer, NCCL, bench smoke,
#      a colocated weight push over CUDA IPC: tests/gpu/test_gpu_weights.py)
#   3. bench-train: slipstream bench train --device cuda --preset mid (tokens/s, MFU vs the
#      measured bf16 matmul peak, peak memory, transformers on the same batch), then
#      --preset qwen3-30b-a3b-4l --no-hf (runs, MFU; issue 29)
#   3b. engine-mid: slipstream bench engine --device cuda --preset mid (native vs HF generate vs
#                  raw decode vs the bandwidth limit; bf16, CUDA graphs; issue 30)
#   4. engine-qwen: the same, --preset qwen3-30b-a3b-4l (no HF baseline)
#   5. e2e:        100 async GRPO steps of the mid shape, trainer and engine on the one GPU
#                  (samples/s, trainer idle share; the run's result line and metrics in the log)
#   opt-in (GPU_CHECK_PHASES): bench (bench engine, quickstart + larger at 32x8),
#                  quickstart (pytest -m "gpu and slow": the quickstart on CUDA learns) and
#                  families (bench engine, bf16, 16x8, on 4 real layers of GLM-4.5-Air,
#                  Mixtral-8x7B and OLMoE-1B-7B: bench/models.py FAMILY_PRESETS; issue 47)
#                  and gpt-oss (bench engine, bf16, 16x8, then bench train --no-hf 2x1024, 90 s each, on
#                  4 real layers of gpt-oss-20b: sinks, windows, biases, clamped SwiGLU; issue 47)
#                  and hybrid (bench engine, bf16, 16x8, on 4 real layers of Qwen3.6-35B-A3B
#                  (3 Gated DeltaNet + 1 gated attention) and of Moonlight-16B-A3B (MLA), then
#                  bench train --no-hf 2x1024 on Moonlight's 4 and on Qwen3.6's GDN + attention
#                  pair: bench/models.py HYBRID_PRESETS; issue 48)
# Each phase has a time limit; the default phases stay under 8 minutes (PHASE_LIMITS below,
# checked by --dry-run). GPU_CHECK_PHASES="gpu-tests quickstart" (say) runs those instead.
# A failing phase does not stop the later ones. OUT_DIR receives at most 8 files:
# gpu-check.json (summary: phases, test counts, every test's recorded figures, provenance),
# gpu-check.log (all output), gpu-tests.jsonl, junit-gpu.xml, engine_mid.json,
# engine_qwen.json, train_mid.json, train_qwen3.json, and with the opt-in phases junit-quickstart.xml, engine_gpu.json, engine_families.json, engine_gpt_oss.json, train_gpt_oss.json, engine_hybrid.json, train_moonlight.json, train_qwen3_6.json.
# Exit 0 when every phase passed. Provenance: set SLIPSTREAM_GIT_COMMIT to
# the commit you sent (the machine may get the tree without .git); a hash of the tree is
# recorded either way.
#
# --dry-run (CI runs it: tests/unit/test_gpu_check.py): builds .wheelhouse/ (needs PyPI) and
# verifies it for CPython 3.12 manylinux x86_64 within the size limit; with a CPython 3.12 on
# this machine, installs it the device's way and imports pydantic/FastAPI/uvicorn and
# slipstream.config with it; checks that the tree plus wheelhouse fit the 64 MiB the device
# takes, that `pytest -m gpu --collect-only` selects the GPU tests (all in tests/gpu, the slow
# one being the quickstart) and that without CUDA they all skip; checks the phase limits.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

WHEELHOUSE=${SLIPSTREAM_WHEELHOUSE:-.wheelhouse}
BUDGET_S=480              # the whole check, install included (the device lends 15 min a session)
INSTALL_LIMIT_S=30
declare -A PHASE_LIMITS=([gpu-tests]=100 [bench]=75 [quickstart]=250)
PHASE_LIMITS+=([engine-mid]=90 [engine-qwen]=60 [e2e]=120)  # issue 30: the engine at GPU scale
PHASE_LIMITS+=([bench-train]=45)  # issue 29: the trainer at GPU scale
PHASE_LIMITS+=([families]=150)  # issue 47 (A): glm4_moe, mixtral, olmoe at real layer shapes
PHASE_LIMITS+=([gpt-oss]=180)  # issue 47 (B): gpt-oss-20b's layer x4, engine then trainer
PHASE_LIMITS+=([hybrid]=240)  # issue 48: Qwen3.6-35B-A3B and Moonlight layers, engine + trainer
DEFAULT_PHASES="gpu-tests bench-train engine-mid engine-qwen e2e"
PHASES=${GPU_CHECK_PHASES:-$DEFAULT_PHASES}
KILL_AFTER_S=5
EXPECTED_GPU_FILES="test_gpu_bench.py test_gpu_engine.py test_gpu_quickstart.py test_gpu_trainer.py"

die() { echo "gpu-check: $*" >&2; exit 2; }
log() { echo "gpu-check: $*"; }

find_python312() {
  local c
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12; do
    if command -v "$c" >/dev/null 2>&1 \
        && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

# ---- dry run ------------------------------------------------------------------------------------

dry_run() {
  local out=${1:-} py=${PYTHON:-.venv/bin/python} failures=0 py312 site tree_b wh_b total
  [[ -x $py ]] || py=python3
  check() {  # check NAME COMMAND...: run, report, count failures
    local name=$1; shift
    if "$@"; then log "ok   $name"; else log "FAIL $name"; failures=$((failures + 1)); fi
  }
  check "wheelhouse built and verified (bash scripts/gpu-wheels.sh)" \
    env PYTHON="$py" bash scripts/gpu-wheels.sh
  if py312=$(find_python312); then
    site=$(mktemp -d)
    check "wheelhouse installs the device's way and imports on $("$py312" -V 2>&1)" \
      bash -c '"$1" -m pip install -q --disable-pip-version-check --no-index --no-deps \
          --no-compile --no-cache-dir --target "$2" "$3"/*.whl > "$2.log" 2>&1 \
          || { cat "$2.log"; exit 1; }
        PYTHONPATH="$2:src" "$1" -c "import pydantic, fastapi, uvicorn, starlette
import slipstream.config as c; c.load_config(None, [])"' _ "$py312" "$site" "$WHEELHOUSE"
    rm -f "$site.log"
    rm -rf "$site"
  else
    log "skip install-and-import check: no CPython 3.12 on this machine (the device runs it)"
  fi
  tree_b=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s+=$1} END {print s+0}')
  wh_b=$(du -sb "$WHEELHOUSE" 2>/dev/null | cut -f1)
  total=$((tree_b + ${wh_b:-0}))
  log "working tree $((tree_b / 1048576)) MiB + wheelhouse $((${wh_b:-0} / 1048576)) MiB"
  check "tree + wheelhouse within the device's 64 MiB" test "$total" -le $((64 * 1048576))
  check "pytest -m gpu selects the GPU tests, all in tests/gpu" collect_check "$py"
  if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    log "skip the no-CUDA skip check: this machine has CUDA"
  else
    check "without CUDA every gpu test skips cleanly" skip_check "$py"
  fi
  local sum=$((INSTALL_LIMIT_S + KILL_AFTER_S)) p
  for p in $DEFAULT_PHASES; do sum=$((sum + PHASE_LIMITS[$p] + KILL_AFTER_S)); done
  check "phase limits of the default phases ($sum s with install and kill margins) within \
${BUDGET_S} s" test "$sum" -le "$BUDGET_S"
  for p in "${!PHASE_LIMITS[@]}"; do
    check "phase $p alone ($((PHASE_LIMITS[$p] + INSTALL_LIMIT_S + 2 * KILL_AFTER_S)) s) within \
${BUDGET_S} s" test $((PHASE_LIMITS[$p] + INSTALL_LIMIT_S + 2 * KILL_AFTER_S)) -le "$BUDGET_S"
  done
  if [[ -n $out ]]; then
    mkdir -p "$out"
    printf '{"mode": "dry-run", "failures": %d, "tree_bytes": %d, "wheelhouse_bytes": %d}\n' \
      "$failures" "$tree_b" "${wh_b:-0}" > "$out/gpu-check-dry-run.json"
  fi
  if ((failures)); then log "dry run: $failures check(s) failed"; return 1; fi
  log "dry run: ready (the full check needs a CUDA machine: bash scripts/gpu-check.sh OUT_DIR)"
}

collect_check() {
  local py=$1 all slow
  all=$("$py" -m pytest -q --collect-only -m gpu -p no:cacheprovider tests 2>&1 | grep '::') || true
  slow=$("$py" -m pytest -q --collect-only -m "gpu and slow" -p no:cacheprovider tests/gpu 2>&1 \
    | grep '::') || true
  echo "$all" | sed 's/^/    /'
  local n f
  n=$(echo "$all" | grep -c '::')
  ((n >= 8)) || { echo "    expected >= 8 gpu tests, got $n"; return 1; }
  if echo "$all" | grep -v '^tests/gpu/' | grep -q '::'; then
    echo "    gpu tests outside tests/gpu (the device run collects only tests/gpu)"; return 1
  fi
  for f in $EXPECTED_GPU_FILES; do
    echo "$all" | grep -q "^tests/gpu/$f::" || { echo "    no gpu test in tests/gpu/$f"; return 1; }
  done
  [[ $(echo "$slow" | grep -c '::') == 1 && $slow == *test_gpu_quickstart.py::* ]] || {
    echo "    'gpu and slow' must select the quickstart test alone: $slow"; return 1; }
}

skip_check() {
  local py=$1 out
  out=$(env -u SLIPSTREAM_GPU_TESTS_ON_CPU "$py" -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu 2>&1)
  local rc=$?
  echo "$out" | tail -1 | sed 's/^/    /'
  [[ $rc == 0 ]] && echo "$out" | tail -1 | grep -Eq '^[0-9]+ skipped' \
    && ! echo "$out" | tail -1 | grep -Eq 'passed|failed|error'
}

# ---- full check (and its rehearsal on the CPU) --------------------------------------------------

PHASES_JSON=()

# The rehearsal checks the plumbing on whatever CPU runs it, not the device's time budget (the dry
# run checks that arithmetic): its limits are the device's times REHEARSAL_LIMIT_FACTOR, so a
# loaded CI host does not fail a phase the GPU would finish in time.
REHEARSAL_LIMIT_FACTOR=${REHEARSAL_LIMIT_FACTOR:-4}

run_phase() {  # run_phase NAME LIMIT_S COMMAND...: time-limited, output to the log
  local name=$1 limit=$2; shift 2
  ((${rehearse:-0})) && limit=$((limit * REHEARSAL_LIMIT_FACTOR))
  local t0=$SECONDS rc
  log "phase $name (limit $limit s): $*"
  timeout --kill-after=$KILL_AFTER_S "$limit" "$@"
  rc=$?
  local wall=$((SECONDS - t0))
  log "phase $name: exit $rc after $wall s$([[ $rc == 124 || $rc == 137 ]] && echo ' (time limit)')"
  PHASES_JSON+=("{\"name\": \"$name\", \"rc\": $rc, \"wall_s\": $wall, \"limit_s\": $limit}")
  return $rc
}

run_named_phase() {  # one phase of the full check (uses full_check's locals: py, pt, slip, ...)
  local name=$1 limit=${PHASE_LIMITS[$1]} args
  case $name in
    gpu-tests)
      run_phase "$name" "$limit" "${pt[@]}" -m "gpu and not slow" --junitxml="$out/junit-gpu.xml" ;;
    quickstart)
      run_phase "$name" "$limit" "${pt[@]}" -m "gpu and slow" \
        --junitxml="$out/junit-quickstart.xml" ;;
    bench)
      args=(--device "$device" --models quickstart,larger --workloads 32x8 --repeats 1)
      ((rehearse)) && args=(--device cpu --models quickstart --workloads 4x4 --max-new-tokens 16
        --repeats 1)
      run_phase "$name" "$limit" "${slip[@]}" bench engine "${args[@]}" \
        --out "$out/engine_gpu.json" ;;
    families)
      # each family's native engine at its real layer shape (random weights, the quickstart's
      # vocabulary); no transformers baseline (minutes at these sizes)
      args=(--device "$device" --models glm-4.5-air-4l,mixtral-8x7b-4l,olmoe-1b-7b-4l
        --workloads 16x8 --repeats 1 --dtype bfloat16 --skip-hf)
      ((rehearse)) && args=(--device cpu --models glm4_moe-quickstart,mixtral-quickstart,olmoe-quickstart
        --workloads 4x4 --max-new-tokens 16 --repeats 1 --skip-hf)
      run_phase "$name" "$limit" "${slip[@]}" bench engine "${args[@]}" \
        --out "$out/engine_families.json" ;;
    gpt-oss)
      # gpt-oss-20b's decoder layer x4 (random weights): the engine (bf16, CUDA graphs, no HF
      # baseline), then one bf16 trainer step shape (no HF copy beside it)
      args=(--device "$device" --models gpt-oss-20b-4l --workloads 16x8 --repeats 1
        --dtype bfloat16 --skip-hf)
      local targs=(--device "$device" --preset gpt-oss-20b-4l --batch 2 --seq-len 1024
        --steps 2 --warmup 1 --no-hf)
      ((rehearse)) && args=(--device cpu --models gpt-oss-quickstart --workloads 4x4
        --max-new-tokens 16 --repeats 1 --skip-hf) && targs=(--device cpu --preset
        gpt-oss-tiny --batch 2 --seq-len 32 --steps 1 --warmup 1 --no-hf)
      # half the phase's limit each
      run_phase "$name-engine" $((limit / 2)) "${slip[@]}" bench engine "${args[@]}" \
        --out "$out/engine_gpt_oss.json" || return 1
      run_phase "$name-train" $((limit / 2)) "${slip[@]}" bench train "${targs[@]}" \
        --out "$out/train_gpt_oss.json" ;;
    hybrid)
      # Qwen3.6-35B-A3B's and Moonlight-16B-A3B's decoder layers x4 (random weights): the engine
      # (bf16, CUDA graphs, the quickstart's vocabulary, no HF baseline), then one bf16 trainer
      # step shape each with the real vocabularies (Qwen3.6: its GDN + attention pair, the 4
      # layers' float32 AdamW state being past an 80 GB GPU; bench/models.py)
      args=(--device "$device" --models qwen3.6-35b-a3b-4l,moonlight-16b-4l --workloads 16x8
        --repeats 1 --dtype bfloat16 --skip-hf)
      local tm=(--device "$device" --preset moonlight-16b-4l --batch 2 --seq-len 1024 --steps 2
        --warmup 1 --no-hf)
      local tq=(--device "$device" --preset qwen3.6-35b-a3b-2l --batch 2 --seq-len 1024 --steps 2
        --warmup 1 --no-hf)
      ((rehearse)) && args=(--device cpu --models qwen3_5_moe-quickstart,deepseek_v3-quickstart
        --workloads 4x4 --max-new-tokens 16 --repeats 1 --skip-hf) && tm=(--device cpu --preset
        deepseek_v3-tiny --batch 2 --seq-len 32 --steps 1 --warmup 1 --no-hf) && tq=(--device
        cpu --preset qwen3_5_moe-tiny --batch 2 --seq-len 32 --steps 1 --warmup 1 --no-hf)
      # half the phase's limit for the engine, a quarter for each trainer run
      run_phase "$name-engine" $((limit / 2)) "${slip[@]}" bench engine "${args[@]}" \
        --out "$out/engine_hybrid.json" || return 1
      run_phase "$name-train-moonlight" $((limit / 4)) "${slip[@]}" bench train "${tm[@]}" \
        --out "$out/train_moonlight.json" || return 1
      run_phase "$name-train-qwen3.6" $((limit / 4)) "${slip[@]}" bench train "${tq[@]}" \
        --out "$out/train_qwen3_6.json" ;;
    engine-mid|engine-qwen)
      local preset=mid json=engine_mid.json
      [[ $name == engine-qwen ]] && preset=qwen3-30b-a3b-4l json=engine_qwen.json
      args=(--device "$device" --preset "$preset" --repeats 1)
      # rehearsal: the preset's flags on the quickstart shape (the real one is minutes on a CPU)
      ((rehearse)) && args=(--device cpu --models quickstart --workloads 4x4 --max-new-tokens 16
        --repeats 1 --dtype bfloat16 $([[ $name == engine-qwen ]] && echo --skip-hf))
      run_phase "$name" "$limit" "${slip[@]}" bench engine "${args[@]}" --out "$out/$json" ;;
    bench-train)
      # the trainer at GPU scale (bench_train below), run by this script under the phase's limit
      run_phase "$name" "$limit" bash "$ROOT/scripts/gpu-check.sh" --bench-train "$out" "$device" \
        "$py" ;;
    e2e)
      # The mid shape (bench/models.py "mid"; the task's own vocabulary) on one device: the
      # trainer in this process, one rollout worker process with the native engine, async GRPO.
      # Untrained (no SFT): rewards are mostly 0, so every step trains anyway
      # (skip_no_signal=false) for the time breakdown of real steps; pass@1 is not the point.
      local e2e_dir=${TMPDIR:-/tmp}/slipstream-gpu-e2e
      rm -rf "$e2e_dir"
      args=(--model.hidden_size=1024 --model.num_hidden_layers=16 --model.num_attention_heads=16
        --model.num_key_value_heads=4 --model.head_dim=64 --model.num_experts=32
        --model.num_experts_per_tok=4 --model.moe_intermediate_size=512
        --run.device="$device" --engine.device="$device" --trainer.steps=100)
      # bf16 on both sides: an fp32 trainer on CUDA takes the per-expert loop (torch._grouped_mm
      # runs in bf16 only), which is not what a GPU user runs
      [[ $device == cuda ]] && args+=(--engine.dtype=bfloat16 --trainer.precision=bf16)
      ((rehearse)) && args=(--run.device=cpu --engine.device=cpu --trainer.steps=2)
      run_phase "$name" "$limit" "${slip[@]}" run -c configs/quickstart.toml --plain \
        --run.output_dir="$e2e_dir" --sft.steps=0 --trainer.eval_every=0 \
        --trainer.checkpoint_every=0 --trainer.skip_no_signal=false --eval.num_prompts=64 \
        "${args[@]}"
      local rc=$?
      [[ -f $e2e_dir/metrics.jsonl ]] && tail -n 3 "$e2e_dir/metrics.jsonl"
      return $rc ;;
  esac
}

bench_train() {  # bench_train OUT DEVICE PYTHON: the bench-train phase's two runs
  local out=$1 device=$2 py=$3
  local cli=("$py" -c 'from slipstream.cli import main; raise SystemExit(main())' bench train
    --device "$device")
  if [[ $device == cpu ]]; then  # rehearsal: the plumbing at a tiny shape
    "${cli[@]}" --preset tiny --batch 2 --seq-len 32 --steps 1 --warmup 1 \
      --out "$out/train_mid.json" || return 1
    "${cli[@]}" --preset tiny --batch 2 --seq-len 32 --steps 1 --warmup 1 --no-hf \
      --out "$out/train_qwen3.json"
    return
  fi
  # mid with transformers' model as the baseline; then Qwen3-30B-A3B's layer x 4 without it
  # (an HF copy of its 3B parameters and their AdamW state would not fit beside ours)
  "${cli[@]}" --preset mid --batch 16 --seq-len 1024 --steps 3 --warmup 2 \
    --out "$out/train_mid.json" || return 1
  "${cli[@]}" --preset qwen3-30b-a3b-4l --batch 4 --seq-len 1024 --steps 2 --warmup 1 --no-hf \
    --out "$out/train_qwen3.json"
}

full_check() {
  local out=$1 rehearse=$2 py device site failed=0
  mkdir -p "$out" || die "cannot create $out"
  out=$(cd "$out" && pwd)
  rm -f "$out"/gpu-check.json "$out"/gpu-tests.jsonl "$out"/junit-*.xml "$out"/engine_*.json \
    "$out"/train_*.json
  exec > >(tee "$out/gpu-check.log") 2>&1
  local t0=$SECONDS
  if ((rehearse)); then
    py=${PYTHON:-.venv/bin/python}; [[ -x $py ]] || py=python3
    device=cpu
    log "REHEARSAL on the CPU: checks this script's phases, says nothing about a GPU"
  else
    py=${PYTHON:-python3}
    device=cuda
    "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
      || die "$py's torch sees no CUDA device (for a run without a GPU: --dry-run or --rehearse)"
  fi
  log "python: $("$py" -V 2>&1) at $(command -v "$py")"

  site=${TMPDIR:-/tmp}/slipstream-gpu-site
  if [[ $("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])') != 3.12 ]]; then
    log "install: skipped (the wheelhouse is for CPython 3.12; $py already has the deps?)"
    site=""
  elif compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
    rm -rf "$site"
    run_phase install "$INSTALL_LIMIT_S" "$py" -m pip install -q --disable-pip-version-check \
      --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELHOUSE"/*.whl \
      || failed=1
  else
    log "install: no $WHEELHOUSE/*.whl (make it with scripts/gpu-wheels.sh and carry it);" \
      "trying the machine's own packages"
    site=""
  fi
  export PYTHONPATH="$ROOT/src${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1 SLIPSTREAM_GPU_RESULTS="$out/gpu-tests.jsonl"
  if ! "$py" -c 'import pydantic, fastapi, uvicorn
import slipstream.config, slipstream.engine.server, slipstream.rl.trainer, slipstream.moe'; then
    log "the project does not import with $py (see above): nothing else can run"
    failed=1
  else
    local pt=("$py" -m pytest -p no:cacheprovider -o junit_family=xunit1 -rA tests/gpu)
    local slip=("$py" -c 'from slipstream.cli import main; raise SystemExit(main())') phase
    for phase in $PHASES; do
      [[ -n ${PHASE_LIMITS[$phase]:-} ]] || { log "unknown phase $phase"; failed=1; continue; }
      run_named_phase "$phase" || failed=1
    done
  fi
  local phases
  phases=$(IFS=,; echo "[${PHASES_JSON[*]}]")
  SUMMARY_PHASES=$phases SUMMARY_FAILED=$failed SUMMARY_WALL=$((SECONDS - t0)) \
    SUMMARY_MODE=$([[ $rehearse == 1 ]] && echo rehearsal || echo gpu) \
    "$py" - "$out" <<'EOF' || failed=1
import hashlib, json, os, subprocess, sys, xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
root = Path.cwd()
def junit(name):
    p = out / name
    if not p.exists():
        return None
    s = ET.parse(p).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    cases = []
    for c in s.iter("testcase"):
        bad = [k.tag for k in c if k.tag in ("failure", "error", "skipped")]
        cases.append({"test": f"{c.get('classname')}::{c.get('name')}",
                      "time_s": float(c.get("time", 0)), "outcome": bad[0] if bad else "passed"})
    counts = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return counts | {"cases": cases}
records = []
rec = out / "gpu-tests.jsonl"
if rec.exists():
    records = [json.loads(l) for l in rec.read_text().splitlines() if l.strip()]
h = hashlib.sha256()  # the code that ran, for a tree sent without .git
files = [root / "pyproject.toml"]
for base in ("src", "tests", "scripts", "configs"):
    files += sorted(p for p in (root / base).rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts)
for f in files:
    h.update(str(f.relative_to(root)).encode())
    h.update(f.read_bytes())
try:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    smi = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    smi = None
from slipstream.observe.provenance import collect_provenance
summary = {
    "check": "scripts/gpu-check.sh", "mode": os.environ["SUMMARY_MODE"],
    "ok": os.environ["SUMMARY_FAILED"] == "0", "wall_s": int(os.environ["SUMMARY_WALL"]),
    "phases": json.loads(os.environ["SUMMARY_PHASES"]),
    "pytest": {"gpu-tests": junit("junit-gpu.xml"), "quickstart": junit("junit-quickstart.xml")},
    "records": records,
    "engine_bench": sorted(p.name for p in out.glob("engine_*.json")),
    "train_bench": sorted(p.name for p in out.glob("train_*.json")),
    "provenance": collect_provenance({"git_commit_sent": os.environ.get("SLIPSTREAM_GIT_COMMIT"),
                                      "tree_sha256": h.hexdigest(), "nvidia_smi": smi}),
}
(out / "gpu-check.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
print(f"gpu-check: wrote {out / 'gpu-check.json'}: ok={summary['ok']}, {summary['wall_s']} s")
EOF
  ((failed)) && { log "FAILED (see $out/gpu-check.log)"; return 1; }
  log "all phases passed in $((SECONDS - t0)) s"
}

case "${1:-}" in
  --dry-run) dry_run "${2:-}" ;;
  --rehearse) [[ -n ${2:-} ]] || die "usage: $0 --rehearse OUT_DIR"; full_check "$2" 1 ;;
  --bench-train) bench_train "$2" "$3" "$4" ;;  # the bench-train phase (run by full_check)
  -h|--help|"") sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; [[ -n ${1:-} ]] ;;
  -*) die "unknown option $1 (see --help)" ;;
  *) full_check "$1" 0 ;;
esac
