"""What dominates a profiled step: a torch.profiler CPU trace folded into phases x kinds of op.

`summarize(prof, op_overhead_s)` returns, from the events of one profiled step:
- self CPU time by phase (forward and everything outside backward/optimizer, backward = inside
  an autograd engine node, optimizer = inside `Optimizer.step` / `zero_grad`) and by kind of op
  (`CATEGORIES`, matched on the aten op name; other aten ops are "other", the self time of
  autograd nodes themselves "autograd", that of record_function ranges such as
  `Optimizer.step#AdamW.step` "record_function self": Python running inside the range),
- how many top-level ops were dispatched (aten ops not called from inside another aten op) and
  what that count costs at the measured per-op overhead (the dispatch floor: time a step spends
  on launching ops even if each computed nothing),
- the step's wall time in the trace and the part of it no op covers (Python between ops),
- the top ops by self time.
The profiler itself slows ops down (more for small ones): shares are the figure, not times.
`combine` takes the median of each number over several profiled steps.
"""

from __future__ import annotations

from typing import Any

CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("matmul", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_grouped_mm",
                "aten::addmv", "aten::mv", "aten::dot", "aten::matmul", "aten::linear")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("index/sort (routing, gather, scatter)",
     ("aten::index", "aten::scatter", "aten::gather", "aten::sort", "aten::argsort",
      "aten::topk", "aten::bincount", "aten::histc", "aten::cumsum", "aten::nonzero",
      "aten::masked_select", "aten::embedding", "aten::repeat_interleave", "aten::unique",
      "aten::take")),
    ("optimizer kernels", ("aten::_foreach", "aten::_fused_adam", "aten::addcdiv",
                           "aten::addcmul", "aten::lerp")),
    ("copy/alloc/layout", ("aten::copy_", "aten::contiguous", "aten::clone", "aten::cat",
                           "aten::stack", "aten::_to_copy", "aten::to", "aten::empty",
                           "aten::zeros", "aten::ones", "aten::full", "aten::fill_",
                           "aten::zero_", "aten::new_", "aten::resize_", "aten::split",
                           "aten::chunk", "aten::narrow", "aten::slice", "aten::select",
                           "aten::view", "aten::reshape", "aten::permute", "aten::transpose",
                           "aten::t", "aten::expand", "aten::unsqueeze", "aten::squeeze",
                           "aten::flatten", "aten::as_strided", "aten::unbind",
                           "aten::detach", "aten::alias", "aten::_unsafe_view")),
    ("softmax/reductions/loss", ("softmax", "aten::sum", "aten::mean", "aten::max",
                                 "aten::amax", "aten::min", "aten::logsumexp", "nll_loss",
                                 "cross_entropy", "norm", "aten::var", "aten::std",
                                 "aten::all", "aten::any", "aten::prod")),
    ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::silu",
                     "aten::sigmoid", "aten::exp", "aten::log", "aten::pow", "aten::rsqrt",
                     "aten::sqrt", "aten::neg", "aten::where", "aten::clamp", "aten::minimum",
                     "aten::maximum", "aten::masked_fill", "aten::abs", "aten::gt", "aten::lt",
                     "aten::eq", "aten::ne", "aten::ge", "aten::le", "aten::rsub",
                     "aten::reciprocal", "aten::_softmax_backward", "aten::threshold",
                     "aten::sign", "aten::logical", "aten::bitwise", "aten::floor",
                     "aten::ceil", "aten::isfinite", "aten::isnan", "aten::mse")),
]  # fmt: skip
PHASES = ("forward", "backward", "optimizer")


def category(name: str) -> str:
    if name.startswith("autograd::") or "Backward" in name:
        return "autograd"
    if not name.startswith("aten::"):
        return "record_function self"  # e.g. Optimizer.step#AdamW.step: Python inside the range
    for cat, patterns in CATEGORIES:
        if any(name.startswith(p) if p.startswith("aten::") else p in name for p in patterns):
            return cat
    return "other"


def phase(event: Any) -> str:
    e = event
    while e is not None:
        if e.name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        if e.name.startswith("Optimizer.step") or e.name.startswith("Optimizer.zero_grad"):
            return "optimizer"
        e = e.cpu_parent
    return "forward"


def summarize(prof: Any, op_overhead_s: float, top: int = 15) -> dict[str, Any]:
    """See the module docstring. `prof`: a finished torch.profiler.profile over one step."""
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    if not events:
        raise ValueError("the profile holds no CPU events (was a step run under it?)")
    by: dict[str, dict[str, float]] = {p: {} for p in PHASES}
    per_op: dict[str, float] = {}
    covered_us = 0.0
    top_level = 0
    for e in events:
        self_us = e.self_cpu_time_total
        ph, cat = phase(e), category(e.name)
        by[ph][cat] = by[ph].get(cat, 0.0) + self_us
        per_op[e.name] = per_op.get(e.name, 0.0) + self_us
        covered_us += self_us
        parent = e.cpu_parent
        if e.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            top_level += 1
    start = min(e.time_range.start for e in events)
    end = max(e.time_range.end for e in events)
    wall_us = max(end - start, 1e-9)
    return {
        "wall_s": wall_us / 1e6,
        "self_s_by_phase": {p: sum(c.values()) / 1e6 for p, c in by.items()},
        "self_s_by_phase_and_category": {
            p: {k: v / 1e6 for k, v in sorted(c.items(), key=lambda kv: -kv[1])}
            for p, c in by.items()
        },  # fmt: skip
        "python_between_ops_s": max(0.0, wall_us - covered_us) / 1e6,
        "num_top_level_ops": top_level,
        "dispatch_floor_s": top_level * op_overhead_s,
        "top_ops_self_s": {
            k: v / 1e6 for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]
        },  # fmt: skip
    }


def combine(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every number over several steps' summaries (a series missing in a step
    counts 0 there), so one step in which the OS preempted an op does not set the picture; the
    top ops are re-ranked by their medians."""
    import statistics

    if not summaries:
        raise ValueError("no profiled step to combine")

    def merge(parts: list[Any]) -> Any:
        if isinstance(parts[0], dict):
            keys = dict.fromkeys(k for p in parts for k in p)
            return {k: merge([p.get(k, 0.0) for p in parts]) for k in keys}
        return statistics.median(parts)

    out = merge(summaries)
    out["top_ops_self_s"] = dict(sorted(out["top_ops_self_s"].items(), key=lambda kv: -kv[1]))
    for phase_cats in out["self_s_by_phase_and_category"].values():
        ranked = sorted(phase_cats.items(), key=lambda kv: -kv[1])
        phase_cats.clear()
        phase_cats.update(ranked)
    out["num_steps"] = len(summaries)
    return out


def format_summary(s: dict[str, Any]) -> str:
    """A few lines for the terminal and the docs."""
    wall = s["wall_s"]
    lines = [f"profiled step {1e3 * wall:.1f} ms (under the profiler): "
             + ", ".join(f"{p} {v / wall:.0%}" for p, v in s["self_s_by_phase"].items())
             + f", Python between ops {s['python_between_ops_s'] / wall:.0%}; "
             f"{s['num_top_level_ops']} ops dispatched = {1e3 * s['dispatch_floor_s']:.1f} ms "
             "at the measured per-op overhead"]  # fmt: skip
    for p, cats in s["self_s_by_phase_and_category"].items():
        parts = [f"{k} {v / wall:.0%}" for k, v in cats.items() if v / wall >= 0.01]
        lines.append(f"  {p:<9} " + ", ".join(parts))
    lines.append("  top ops: " + ", ".join(f"{k} {v / wall:.0%}" for k, v in
                                           list(s["top_ops_self_s"].items())[:8]))  # fmt: skip
    return "\n".join(lines)
