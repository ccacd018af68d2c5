import sys, torch
from torch.profiler import profile, ProfilerActivity
from slipstream.bench.engine import _build_model
from slipstream.engine.kv_cache import Part, SlotKVCache
torch.set_num_threads(1)
model = _build_model("quickstart", 40, 160, "cpu", 0)
B = int(sys.argv[1]); steps = 40; P = 16
cache = SlotKVCache.for_model(model, B, P + steps + 1)
parts = [Part(b, b * P, P) for b in range(B)]
feed = torch.randint(3, 40, (steps, B, 1))
with torch.inference_mode():
    cache.begin_mixed(torch.empty(0, dtype=torch.long), -1, parts)
    model(torch.randint(3, 40, (1, B * P)), position_ids_BT=torch.arange(P).repeat(B)[None], cache=cache)
    for s in range(5):
        pos_B = torch.full((B,), P + s); cache.begin_decode(pos_B, P + s); model(feed[s], position_ids_BT=pos_B[:, None], cache=cache)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for s in range(5, steps):
            pos_B = torch.full((B,), P + s); cache.begin_decode(pos_B, P + s); model(feed[s], position_ids_BT=pos_B[:, None], cache=cache)
n = steps - 5
ev = prof.key_averages()
tot = sum(e.self_cpu_time_total for e in ev)
print(f"B={B}: self CPU total {tot/n/1e3:.2f} ms/step, ops/step {sum(e.count for e in ev)/n:.0f}")
for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:25]:
    print(f"{e.key:40s} {e.count/n:6.1f}/step {e.self_cpu_time_total/n:8.1f} us/step")
print("--- by shape")
ev2 = prof.key_averages(group_by_input_shape=True)
for e in sorted(ev2, key=lambda e: -e.self_cpu_time_total)[:10]:
    print(f"{e.key:14s} {str(e.input_shapes)[:70]:70s} {e.count/n:5.1f} {e.self_cpu_time_total/n:8.1f} us")
