"""Decode step time at B rows: eager vs torch.compile variants (quickstart model, 1 thread)."""
import sys, time, torch
from slipstream.bench.engine import _build_model
from slipstream.engine.kv_cache import Part, SlotKVCache
torch.set_num_threads(1)
name = sys.argv[1] if len(sys.argv) > 1 else "quickstart"
mode = sys.argv[2] if len(sys.argv) > 2 else "eager"
model = _build_model(name, 40, 160, "cpu", 0)
fwd = model
if mode == "compile":
    fwd = torch.compile(model, dynamic=True)
elif mode == "compile-layers":
    for layer in model.model.layers if hasattr(model, "model") else model.layers:
        layer.self_attn.forward = torch.compile(layer.self_attn.forward, dynamic=True)
def step_ms(B, steps=60, prompt_len=16):
    cache = SlotKVCache.for_model(model, B, prompt_len + steps + 1)
    ids = torch.randint(3, 40, (B, prompt_len))
    feed = torch.randint(3, 40, (steps, B, 1))
    parts = [Part(b, b * prompt_len, prompt_len) for b in range(B)]
    prefill_pos = torch.arange(prompt_len).repeat(B)[None]
    best = 1e9
    with torch.inference_mode():
        for rep in range(3):
            cache.begin_mixed(torch.empty(0, dtype=torch.long), -1, parts)
            model(ids.reshape(1, -1), position_ids_BT=prefill_pos, cache=cache)
            t0 = time.perf_counter()
            for s in range(steps):
                pos_B = torch.full((B,), prompt_len + s)
                cache.begin_decode(pos_B, prompt_len + s)
                out = fwd(feed[s], position_ids_BT=pos_B[:, None], cache=cache)
            best = min(best, (time.perf_counter() - t0) / steps * 1e3)
    return best, out.logits_BTV
t0 = time.perf_counter()
for B in (1, 8, 20, 40, 64):
    ms, _ = step_ms(B)
    print(f"{name} {mode} B={B}: {ms:.2f} ms/step  {B/ms*1e3:.0f} tok/s", flush=True)
print("total", time.perf_counter() - t0)
