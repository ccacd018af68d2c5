import sys, time, torch, torch.nn.functional as F
from slipstream.config import load_config
from slipstream.sft import build_model, collate
from slipstream.tasks import get_taskset
from torch.nn.utils import clip_grad_norm_
torch.set_num_threads(1)
cfg = load_config("configs/quickstart.toml")
ts = get_taskset(cfg.task)
model = build_model(cfg, ts.tokenizer, torch.device("cpu"), torch.float32); model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
def step(i, bs):
    x, y, m = collate(ts, ts.train_batch(i * bs, bs), torch.device("cpu"), 64)
    real = x != ts.tokenizer.pad_id
    out = model(x, skip_padding_BT=real)
    ce = F.cross_entropy(out.logits_BTV.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    loss = (ce * m).sum() / m.sum()
    opt.zero_grad(set_to_none=True); (loss + out.aux_loss).backward()
    clip_grad_norm_(list(model.parameters()), 1.0); opt.step(); loss.item()
for rnd in range(3):
    for bs in (64, 96, 128):
        for i in range(5): step(i, bs)
        t0 = time.perf_counter()
        for i in range(5, 45): step(i, bs)
        ms = (time.perf_counter() - t0) / 40 * 1e3
        print(f"round {rnd} bs {bs}: {ms:.1f} ms/step, {ms/bs*64:.1f} ms per 64 rows", flush=True)
