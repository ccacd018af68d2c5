# ms per SFT-like quickstart step, 1 thread: `python sft_step.py grouped 100` (BS=64 default).
"""ms per SFT-like step (fwd+bwd+AdamW) on quickstart batches; args: impl [steps]"""
import sys, time, torch, torch.nn.functional as F
from slipstream.config import load_config
from slipstream.tasks import get_taskset
from slipstream.sft import collate
from slipstream.sft import build_model
from slipstream.runtime import setup_torch
import os; BS=int(os.environ.get("BS","64"))
impl = sys.argv[1]; steps = int(sys.argv[2]) if len(sys.argv) > 2 else 100
cfg = load_config("configs/quickstart.toml")
device, dtype = setup_torch(cfg.run)
ts = get_taskset(cfg.task)
model = build_model(cfg, ts.tokenizer, device, dtype); model.train()
from slipstream.model.moe import SparseMoeBlock
for mod in model.modules():
    if isinstance(mod, SparseMoeBlock): mod.impl = impl
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
batches = [collate(ts, ts.train_batch(s*BS, BS), device, cfg.rollout.max_observation_tokens) for s in range(steps)]
def run(n):
    for s in range(n):
        i, t, m = batches[s % len(batches)]
        real = i != ts.tokenizer.pad_id
        out = model(i, token_mask_BT=real, moe_skip_padding_BT=real)
        ce = F.cross_entropy(out.logits_BTV.flatten(0,1), t.flatten(), reduction="none").view_as(t)
        loss = (ce*m).sum()/m.sum()
        opt.zero_grad(set_to_none=True); (loss+out.aux_loss).backward(); opt.step(); loss.item()
run(20)
res = []
for r in range(3):
    c = time.thread_time(); run(steps); res.append((time.thread_time()-c)/steps*1e3)
print(impl, " ".join(f"{x:.1f}" for x in res), "ms/step (thread CPU)")
