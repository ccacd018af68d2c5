"""ms per SFT step (fwd+bwd+AdamW, quickstart batches, 1 thread); old API or new."""
import sys, time, inspect, torch, torch.nn.functional as F
import slipstream
from slipstream.config import load_config
from slipstream.tasks import get_taskset
from slipstream.sft import collate, build_model
from slipstream.runtime import setup_torch
from slipstream.model import MoEForCausalLM
new = "skip_padding_BT" in inspect.signature(MoEForCausalLM.forward).parameters
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
cfg = load_config("/work/main/configs/quickstart.toml"); device, dtype = setup_torch(cfg.run)
ts = get_taskset(cfg.task); torch.manual_seed(0)
model = build_model(cfg, ts.tokenizer, device, dtype); model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
batches = [collate(ts, ts.train_batch(s*64, 64), device, 64) for s in range(steps)]
def run(n):
    for s in range(n):
        i, t, m = batches[s % len(batches)]; real = i != ts.tokenizer.pad_id
        out = model(i, skip_padding_BT=real) if new else model(i, token_mask_BT=real, moe_skip_padding_BT=real)
        ce = F.cross_entropy(out.logits_BTV.flatten(0,1), t.flatten(), reduction="none").view_as(t)
        loss = (ce*m).sum()/m.sum()
        opt.zero_grad(set_to_none=True); (loss+out.aux_loss).backward(); opt.step(); loss.item()
    return loss.item()
run(20)
res = []
for r in range(3):
    c = time.thread_time(); l = run(steps); res.append((time.thread_time()-c)/steps*1e3)
print("new" if new else "old", " ".join(f"{x:.1f}" for x in res), f"ms/step  loss {l:.5f}", flush=True)
