import sys, inspect, torch, torch.nn.functional as F
from slipstream.config import load_config
from slipstream.tasks import get_taskset
from slipstream.sft import collate, build_model
from slipstream.runtime import setup_torch
from slipstream.model import MoEForCausalLM
new = "skip_padding_BT" in inspect.signature(MoEForCausalLM.forward).parameters
cfg = load_config("/work/main/configs/quickstart.toml"); device, dtype = setup_torch(cfg.run)
ts = get_taskset(cfg.task); torch.manual_seed(0)
model = build_model(cfg, ts.tokenizer, device, dtype); model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
out_l = []
for s in range(200):
    i, t, m = collate(ts, ts.train_batch(s*64, 64), device, 64); real = i != ts.tokenizer.pad_id
    out = model(i, skip_padding_BT=real) if new else model(i, token_mask_BT=real, moe_skip_padding_BT=real)
    ce = F.cross_entropy(out.logits_BTV.flatten(0,1), t.flatten(), reduction="none").view_as(t)
    loss = (ce*m).sum()/m.sum()
    opt.zero_grad(set_to_none=True); (loss+out.aux_loss).backward(); opt.step()
    if s in (0,1,5,20,50,100,199): out_l.append(f"{s}:{loss.item():.7f}")
print("new" if new else "old", " ".join(out_l))
