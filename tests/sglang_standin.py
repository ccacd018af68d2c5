"""A stand-in for SGLang's engine end of the weight-update protocol (issue 44 interop tests):
`python sglang_standin.py PORT OUT.json` serves /health, /init_weights_update_group,
/update_weights_from_distributed and /destroy_weights_update_group with SGLang's bodies and
answers, forming the group with SGLang's `init_custom_process_group` (sglang_pg.py) and
receiving each tensor as SGLang's `ModelRunner.update_weights_from_distributed` does (an empty
tensor of the declared dtype and shape, `torch.distributed.broadcast(weight, src=0,
group=group)`). What it received is written to OUT.json (per name, the float64 sum)."""

from __future__ import annotations

import datetime
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from sglang_pg import init_custom_process_group  # noqa: E402

groups: dict[str, object] = {}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, ok: bool, message: str) -> None:
        body = json.dumps({"success": ok, "message": message}).encode()
        self.send_response(200 if ok else 400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(True, "ok")  # /health

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        try:
            if self.path == "/init_weights_update_group":
                groups[req["group_name"]] = init_custom_process_group(
                    backend=req["backend"],
                    init_method=f"tcp://{req['master_address']}:{req['master_port']}",
                    world_size=req["world_size"], rank=req["rank_offset"],
                    group_name=req["group_name"], timeout=datetime.timedelta(seconds=60))  # fmt: skip
                self._answer(True, "Succeeded to initialize custom process group.")
            elif self.path == "/update_weights_from_distributed":
                assert req.get("load_format") in (None, "auto"), req.get("load_format")
                group = groups[req["group_name"]]
                sums = {}
                for name, dtype, shape in zip(
                    req["names"], req["dtypes"], req["shapes"], strict=True
                ):
                    weight = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(weight, src=0, group=group)
                    sums[name] = float(weight.double().sum())
                out = Path(sys.argv[2])
                seen = json.loads(out.read_text()) if out.exists() else {}
                if seen.get("weight_version") != req.get("weight_version"):
                    seen = {"weight_version": req.get("weight_version"), "sums": {}}
                seen["sums"].update(sums)
                out.write_text(json.dumps(seen))
                self._answer(True, "Succeeded to update parameter online.")
            elif self.path == "/destroy_weights_update_group":
                dist.destroy_process_group(groups.pop(req["group_name"]))
                self._answer(True, "Succeeded to destroy custom process group.")
            else:
                self._answer(False, f"no route {self.path}")
        except Exception as e:  # noqa: BLE001 - SGLang answers failures as success false
            self._answer(False, f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
