"""A plan's ranking as rows: JSON (`zero-jax plan --json`) and the printed
table, with its legend (which figures are exact, which estimated)."""

from __future__ import annotations

from zero_jax.planner import choices, cost
from zero_jax.planner.choices import Cluster


def row(e: cost.Estimate, cluster: Cluster, rank: int, wider: str = "") -> dict:
    """One ranked layout as a JSON row (--json; the table prints from it too)."""
    n, dev = cluster.size, cluster.device
    out = {"rank": rank, "layout": e.choice.label, "fits": e.fits,
           "bytes": {"params": e.memory.state["params"], "opt_state": e.memory.state["opt_state"],
                     **{f"step_{k}": v for k, v in e.memory.phases.items()},
                     "total_estimate": e.memory.device_bytes, "host": e.memory.host_bytes},
           "reserve_bytes": e.reserve, "headroom": e.headroom, "step_s": e.time.step_s,
           "compute_s": e.time.compute_s, "comm_s": e.time.comm_s, "bubble": e.time.bubble,
           "tokens_per_s": e.time.tokens_per_s,
           "model_tflops_per_device": e.time.tflops_per_device(n),
           "hardware_tflops_per_device": e.time.hardware_tflops_per_device(n),
           "mfu": e.time.mfu(n, dev.peak_flops), "at_mfu_ceiling": e.time.at_ceiling}
    if e.compiled:
        keys = ("error", "argument_bytes", "temp_bytes", "collective_bytes", "collectives")
        out["compiled"] = {k: e.compiled[k] for k in keys if k in e.compiled}
        out["compiled_vs_estimate"] = (cost.against_compiled(e, wider) if "temp_bytes" in e.compiled
                                       else "twin's collectives" if e.choice.offload else None)
    return out


def table_line(r: dict) -> str:
    c = r.get("compiled") or {}
    cpu = (f"{(c['argument_bytes'] + c['temp_bytes']) / 1e9:.1f}" if "temp_bytes" in c else
           "err" if "error" in c else "twin" if "collectives" in c else "-")
    return (f"{r['rank']:>4}  {r['layout']:<72}{'yes' if r['fits'] else 'no':>5}"
            f"{r['bytes']['total_estimate'] / 1e9:>7.1f}{r['reserve_bytes'] / 1e9:>8.1f}"
            f"{cpu:>8}  {r.get('compiled_vs_estimate') or '':<28}"
            f"{r['bytes']['host'] / 1e9:>8.1f}{r['headroom']:>7.0%}"
            f"{r['step_s']:>9.2f}{r['tokens_per_s']:>13,.0f}{r['model_tflops_per_device']:>8.1f}"
            f"{r['hardware_tflops_per_device']:>8.1f}{r['mfu']:>6.0%}"
            + ("^" if r["at_mfu_ceiling"] else ""))


def top_line(r: dict) -> str:
    """The best layout's bytes and time, each with where it comes from."""
    b = r["bytes"]
    return (f"top: {r['layout']}: headroom {r['headroom']:.0%} of a device beyond the estimate "
            f"and the reserve; params {b['params'] / 1e9:.2f} GB + optimizer state "
            f"{b['opt_state'] / 1e9:.2f} GB stored (exact, from the shardings); step "
            f"temporaries, estimated (the largest counts): "
            + ", ".join(f"{k[5:]} {v / 1e9:.2f} GB" for k, v in b.items() if k.startswith("step_"))
            + f"; time: compute {r['compute_s']:.2f} s"
            + "".join(f", {a} {s:.2f} s" for a, s in r["comm_s"].items())
            + (" (collectives measured in the compiled program)" if "collectives" in
               (r.get("compiled") or {}) else " (all estimated)")
            + (f", bubble {r['bubble']:.1%} of the schedule" if r["bubble"] else ""))


def print_table(rows: list[dict], device, fitting: int, total: int) -> None:
    host = (f" and {device.host_bytes_per_node / 2**40:.0f} TiB of host memory per node"
            if device.can_offload else "")
    print(f"{fitting} of {total} layouts fit in {device.hbm_bytes / 1e9:.1f} GB{host} "
          f"with the reserve (estimate; 'reserve': kept free for collectives, workspaces and "
          f"fragmentation; 'CPU GB': compiled here, then which figure bounds which "
          f"(docs/planning.md); 'twin': an offload layout, its collectives those of the same "
          f"layout compiled without offload; "
          f"'host GB': offloaded, per device; TFLOP/s per device, 'model' 6N + attention, "
          f"'hw' Megatron's formula: where the layout recomputes, every layer's forward once more)")
    print(f"step s, tok/s, TFLOP/s and MFU are estimated from the kernels' shapes and the links "
          f"(docs/planning.md#how-the-step-time-is-estimated); the largest uncertainty is the "
          f"{device.name} step efficiency, {device.step_efficiency:.2f}, one figure fitted to the "
          f"published runs of docs/planning.md#published-runs"
          + ("" if device.gemm_sweep else
             f"; '^': held at the best MFU published for the kind, {device.mfu_ceiling:.0%}"))
    print(f"{'#':>4}  {'layout':<72}{'fits':>5}{'GB':>7}{'reserve':>8}{'CPU GB':>8}"
          f"  {'CPU GB vs GB':<28}{'host GB':>8}"
          f"{'head':>7}{'step s':>9}{'tok/s':>13}{'model':>8}{'hw':>8}{'MFU':>6}")
    for r in rows:
        print(table_line(r))
    if rows:
        print(top_line(rows[0]))


def experts_caveat(model_cfg, best: cost.Estimate | None = None, cluster: Cluster | None = None,
                   exchange: str = "ragged", gemm: str = "tiled", dispatch: str = "auto") -> str:
    """How a mixture of experts is priced, for the best layout where given,
    and what the figures do not yet stand on; "" for a dense model."""
    if not getattr(model_cfg, "n_experts", 0):
        return ""
    moved = ("ragged all-to-alls of the routed copies (ragged_all_to_all, as a GPU runs it)"
             if exchange == "ragged" else "padded all-to-alls, each peer's block sized for the "
             "worst case (e times the routed copies)")
    where = ""
    if best is not None and cluster is not None:
        span = choices.expert_span(model_cfg, dispatch, best.choice, cluster)
        head = (f" The best layout's expert axis spans {span.nodes} nodes; a token reaches at "
                f"most {span.reach} of them (group-limited routing)")
        if span.two_hops:
            where = (f"{head} and crosses the inter-node link once for each but its own, then "
                     "its copies fan out inside the node (two hops).")
        elif span.nodes > 1:
            where = (f"{head}, its {model_cfg.n_experts_per_tok} copies travelling one by one "
                     "(--expert-dispatch direct): 1 - 1/nodes of them cross the inter-node link.")
    return (f"a mixture of experts: its experts priced as {moved} and {gemm} grouped GEMMs "
            f"at the routed tokens' FLOPs and a dense GEMM's efficiency, the dispatch's "
            f"buffers sized for the worst case.{where} No published run of a mixture has been "
            "checked against these estimates (docs/experts.md): rank layouts with them, do "
            "not book on them")
