# A/B harness: SFT-shaped quickstart steps (fwd+bwd+AdamW) with the controller's publish after each:
# `python publish_ab_harness.py grouped 100` in the repo root (old code: PYTHONPATH=<old tree>/src).
import sys, time, tempfile, resource, inspect, torch
import os; exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'sft_step.py')).read().split("run(20)")[0])
import slipstream
from slipstream.storage import WeightStore
from slipstream.rl.publisher import Publisher
from slipstream.rl.trainer import Trainer
from slipstream.model.checkpoint import hf_from_internal, hf_config_from_model_config
new = "copy" in inspect.signature(Trainer.full_state).parameters
class Coord:
    def set_version(self, v): pass
pub = Publisher(WeightStore(tempfile.mkdtemp(), keep_last=3), Coord())
hfc = hf_config_from_model_config(model.config, torch.float32)
def publish(v):
    live = {k: t.detach() for k, t in model.state_dict().items()}
    state = live if new else {k: t.clone() for k, t in live.items()}
    pub.submit(v, hf_from_internal(state, model.config), hfc)
run(20)
for r in range(3):
    r0 = resource.getrusage(resource.RUSAGE_SELF); w = time.perf_counter()
    for s in range(100):
        run(1); publish(r * 100 + s)
    pub.flush()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print("new" if new else "old", slipstream.__file__.split('/src/')[0], f"user {(r1.ru_utime-r0.ru_utime)*10:.1f} sys {(r1.ru_stime-r0.ru_stime)*10:.1f} ms/step, wall {(time.perf_counter()-w)/100*1e3:.1f} ms/step")
