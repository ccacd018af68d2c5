"""Print `--model.k=v` overrides (TOML values) for a bench/models.py preset."""
import json, sys
from slipstream.bench.models import MODELS
for k, v in MODELS[sys.argv[1]].items():
    if v is None:
        continue
    val = json.dumps(v, separators=(",", ":"))
    print(f"--model.{k}={val}")
