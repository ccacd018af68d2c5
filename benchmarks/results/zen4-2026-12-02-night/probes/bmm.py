import time, torch
torch.set_num_threads(1)
E, D, I2 = 8, 128, 256
W = torch.randn(E, I2, D)          # (E, 2I, D) stored; used transposed
Wt = W.transpose(1, 2)
Wc = Wt.contiguous()
def t(fn, reps=300):
    for _ in range(20): fn()
    t0 = time.perf_counter()
    for _ in range(reps): fn()
    return (time.perf_counter() - t0) / reps * 1e6
with torch.inference_mode():
  for C in (8, 9, 10, 11, 16, 37, 40):
    x = torch.randn(E, C, D)
    print(C, f"bmm(view^T) {t(lambda: torch.bmm(x, Wt)):.0f}us  bmm(contig) {t(lambda: torch.bmm(x, Wc)):.0f}us  "
          f"matmul {t(lambda: torch.matmul(x, Wt)):.0f}us  loop-linear {t(lambda: [torch.nn.functional.linear(x[e], W[e]) for e in range(E)]):.0f}us  "
          f"einsum {t(lambda: torch.einsum('ecd,eid->eci', x, W)):.0f}us")
  # varying shapes
  xs = [torch.randn(E, C, D) for C in range(6, 16)]
  i = [0]
  def vary():
      i[0] = (i[0] + 1) % len(xs); torch.bmm(xs[i[0]], Wt)
  print("varying C 6-15 bmm(view^T):", f"{t(vary):.0f}us")
  def vary_c():
      i[0] = (i[0] + 1) % len(xs); torch.bmm(xs[i[0]], Wc)
  print("varying C 6-15 bmm(contig):", f"{t(vary_c):.0f}us")
