# run in the repo root: `python unpadded_prototype.py 64` (batch size); scratch code, not the product.
"""Prototype: every per-token layer on the real tokens only (attention scatters to the padded
layout for SDPA alone). Compares time and values with the current forward (MoE-only skip)."""
import sys, time, torch, torch.nn.functional as F
from slipstream.config import load_config
from slipstream.tasks import get_taskset
from slipstream.sft import collate, build_model
from slipstream.runtime import setup_torch
from slipstream.model.layers import rope_cos_sin, _rotate_half
from slipstream.model.kv_cache import causal_attend
from slipstream.model.moe import SparseMoeBlock
cfg = load_config("configs/quickstart.toml"); device, dtype = setup_torch(cfg.run)
ts = get_taskset(cfg.task); model = build_model(cfg, ts.tokenizer, device, dtype); model.train()
BS = int(sys.argv[1]) if len(sys.argv) > 1 else 64
batches = [collate(ts, ts.train_batch(s * BS, BS), device, 64) for s in range(50)]

def attn_packed(a, x_MD, cos_MD, sin_MD, rows_M, B, T):
    H, K, Dh = a.num_heads, a.num_kv_heads, a.head_dim
    M = x_MD.shape[0]
    q = a.q_norm(a.q_proj(x_MD).view(M, H, Dh)); k = a.k_norm(a.k_proj(x_MD).view(M, K, Dh))
    v = a.v_proj(x_MD).view(M, K, Dh)
    c, s = cos_MD[:, None], sin_MD[:, None]
    q = q * c + _rotate_half(q) * s; k = k * c + _rotate_half(k) * s
    qkv_M = torch.cat((q, k, v), dim=1)  # (M, H+2K, Dh)
    full = qkv_M.new_zeros(B * T, H + 2 * K, Dh).index_copy(0, rows_M, qkv_M).view(B, T, H + 2 * K, Dh)
    qB, kB, vB = full[:, :, :H].transpose(1, 2), full[:, :, H:H + K].transpose(1, 2), full[:, :, H + K:].transpose(1, 2)
    out = causal_attend(qB, kB, vB).transpose(1, 2).reshape(B * T, H * Dh).index_select(0, rows_M)
    return a.o_proj(out)

def forward_unpadded(model, ids_BT, real_BT):
    B, T = ids_BT.shape
    rows_M = real_BT.reshape(-1).nonzero().squeeze(1)
    pos_BT = model.default_position_ids(B, T, None, ids_BT.device)
    x_MD = model.model.embed_tokens(ids_BT.reshape(-1).index_select(0, rows_M))
    cos, sin = rope_cos_sin(pos_BT.reshape(-1).index_select(0, rows_M)[None], model.config.head_dim, model.config.rope_theta, x_MD.dtype)
    cos, sin = cos[0], sin[0]
    rls = []
    for layer in model.model.layers:
        x_MD = x_MD + attn_packed(layer.self_attn, layer.input_layernorm(x_MD), cos, sin, rows_M, B, T)
        h = layer.post_attention_layernorm(x_MD)
        out, rl = layer.mlp._tokens(h, None)
        x_MD = x_MD + out; rls.append(rl)
    logits_MV = model.lm_head(model.model.norm(x_MD)).float()
    logits = logits_MV.new_zeros(B * T, logits_MV.shape[1]).index_copy(0, rows_M, logits_MV).view(B, T, -1)
    from slipstream.model.moe import load_balancing_loss
    aux = model.config.router_aux_loss_coef * load_balancing_loss(rls, model.config.num_experts, model.config.num_experts_per_tok, None)
    return logits, aux

def loss_of(logits, aux, t, m):
    ce = F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="none").view_as(t)
    return (ce * m).sum() / m.sum() + aux

i, t, m = batches[0]; real = i != ts.tokenizer.pad_id
out = model(i, token_mask_BT=real, moe_skip_padding_BT=real)
lo2, aux2 = forward_unpadded(model, i, real)
print("max |logit diff| at real positions", (out.logits_BTV - lo2)[real].abs().max().item(), "aux", out.aux_loss.item(), aux2.item())
def cur(b):
    i, t, m = b; real = i != ts.tokenizer.pad_id
    o = model(i, token_mask_BT=real, moe_skip_padding_BT=real); loss_of(o.logits_BTV, o.aux_loss, t, m).backward()
def new(b):
    i, t, m = b; real = i != ts.tokenizer.pad_id
    lo, aux = forward_unpadded(model, i, real); loss_of(lo, aux, t, m).backward()
for f in (cur, new): [f(b) for b in batches[:10]]
for r in range(6):
    for name, f in (("current", cur), ("unpadded", new)):
        c = time.thread_time(); [f(b) for b in batches]; print(name, f"{(time.thread_time() - c) / len(batches) * 1e3:.1f} ms fwd+bwd")
