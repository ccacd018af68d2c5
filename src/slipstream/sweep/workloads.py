"""Built-in sweep workloads, one per execution pattern of seed 002, plus the user's own command.

Each workload is a list of exec turns (argv lists run inside the sandbox) and a host-side think time
between turns; a latency sample is the wall time from the first turn's start to the last turn's
end. Every built-in needs only `python3` and `sh` in the sandbox (`build` uses gcc when the sandbox
has it and says which it did in its output). They exit non-zero when their own check fails, so a
broken sandbox shows up as a failed sample, not as a fast one.

Sizes at scale 1 take roughly 0.05-0.3 s on one idle vCPU of the dev machines. Not covered:
network-bound workloads (sandboxes have no network).
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.config.sweep import SweepConfig


@dataclass(frozen=True)
class Workload:
    name: str
    turns: tuple[tuple[str, ...], ...]
    think_s: float = 0.0


_CPU_LOOP = """
n = {n}
x = 0
for i in range(n):
    x += i * i
assert x > 0
"""

# A tiny "solution + hidden tests" pair, written to files and loaded like a verifier would.
_VERIFY = r'''
import os, sys, tempfile, unittest
d = tempfile.mkdtemp()
open(os.path.join(d, "solution.py"), "w").write("""
def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
def is_palindrome(s):
    t = [c.lower() for c in s if c.isalnum()]
    return t == t[::-1]
def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
""")
tests = ["import unittest, random", "from solution import fib, is_palindrome, merge_sorted",
         "class T(unittest.TestCase):"]
for k in range({num_tests}):
    tests.append(f"    def test_fib_{{k}}(self): self.assertEqual(fib({{k % 30}} + 2), fib({{k % 30}} + 1) + fib({{k % 30}}))")
    tests.append(f"    def test_pal_{{k}}(self): self.assertTrue(is_palindrome('Ab{{k}}' + '{{k}}'[::-1] + 'bA') and not is_palindrome('ab{{k}}x'))")
    tests.append(
        f"    def test_merge_{{k}}(self):\n"
        f"        r = random.Random({{k}}); a = sorted(r.sample(range(999), 60)); b = sorted(r.sample(range(999), 60))\n"
        f"        self.assertEqual(merge_sorted(a, b), sorted(a + b))")
open(os.path.join(d, "test_solution.py"), "w").write("\n".join(tests) + "\n")
sys.path.insert(0, d)
suite = unittest.defaultTestLoader.discover(d)
result = unittest.TextTestRunner(stream=open(os.devnull, "w")).run(suite)
sys.exit(0 if result.wasSuccessful() and result.testsRun == {num_tests} * 3 else 1)
'''

_BUILD = r"""
set -e
d=$(mktemp -d)
cd "$d"
if command -v gcc >/dev/null 2>&1; then
  i=0
  while [ $i -lt @NUM_UNITS@ ]; do
    cat > u$i.c <<EOF
static unsigned long mix$i(unsigned long x) { for (int k = 0; k < 64; k++) x = x * 6364136223846793005UL + $i; return x; }
unsigned long unit$i(unsigned long x) { return mix$i(x) ^ (x >> 3); }
EOF
    i=$((i+1))
  done
  { echo '#include <stdio.h>'; j=0; while [ $j -lt @NUM_UNITS@ ]; do echo "unsigned long unit$j(unsigned long);"; j=$((j+1)); done
     echo 'int main(void) { unsigned long x = 1;'; j=0; while [ $j -lt @NUM_UNITS@ ]; do echo "x = unit$j(x);"; j=$((j+1)); done
     echo 'printf("%lu", x); return 0; }'; } > main.c
  gcc -O1 -c u*.c main.c
  gcc -o prog ./*.o
  ./prog >/dev/null
  echo built-with-gcc
else
  python3 - <<'EOF'
import compileall, os
os.makedirs("pkg", exist_ok=True)
for i in range(@NUM_UNITS@ * 4):
    open(f"pkg/m{i}.py", "w").write("\n".join(f"def f{k}(x):\n    return x * {k} + {i}" for k in range(200)))
assert compileall.compile_dir("pkg", quiet=1)
EOF
  echo built-with-compileall
fi
"""

_IO = """
import os, subprocess, tempfile
d = tempfile.mkdtemp()
for i in range({num_files}):
    with open(os.path.join(d, f"f{{i}}.txt"), "w") as f:
        f.write("line %d\\n" % i * 8)
total = 0
for name in os.listdir(d):
    with open(os.path.join(d, name)) as f:
        total += len(f.read())
    os.stat(os.path.join(d, name))
for i in range({num_procs}):
    subprocess.run(["true"], check=True)
for name in os.listdir(d):
    os.unlink(os.path.join(d, name))
assert total > 0
"""

_EPISODE_TURN = """
import os, tempfile
x = 0
for i in range({n}):
    x += i % 7
with open(os.path.join(tempfile.gettempdir(), "turn.txt"), "a") as f:
    f.write(str(x))
"""


def build_workload(cfg: SweepConfig) -> Workload:
    """The workload the sweep runs in every sandbox, from `workload`/`workload_cmd`/`workload_scale`."""
    s = cfg.workload_scale
    if cfg.workload_cmd is not None:
        return Workload("cmd", (("sh", "-c", cfg.workload_cmd),))
    if cfg.workload == "cpu-loop":
        src = _CPU_LOOP.format(n=max(1, int(1_500_000 * s)))
        return Workload("cpu-loop", (("python3", "-c", src),))
    if cfg.workload == "verify":
        src = _VERIFY.format(num_tests=max(1, int(20 * s)))
        return Workload("verify", (("python3", "-c", src),))
    if cfg.workload == "build":
        src = _BUILD.replace("@NUM_UNITS@", str(max(1, int(4 * s))))
        return Workload("build", (("sh", "-c", src),))
    if cfg.workload == "io":
        src = _IO.format(num_files=max(1, int(300 * s)), num_procs=max(1, int(5 * s)))
        return Workload("io", (("python3", "-c", src),))
    if cfg.workload == "episode":
        turn = ("python3", "-c", _EPISODE_TURN.format(n=max(1, int(200_000 * s))))
        return Workload("episode", (turn,) * cfg.episode_turns, think_s=cfg.episode_think_s)
    raise ValueError(f"unknown workload {cfg.workload!r}")
