"""The GPU driver's report (bench/vllm_e2e.py): quality against the CPU's numbers, the perf plot, the
merge of several calls' JSONs and the markdown tables for bench/README.md. CPU only (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

from e2e_jobs import ROOT, log

def compare_quality(gpu: dict, dtype: str) -> dict:
    """GPU eval_quality JSON vs the committed CPU JSONs: accuracy and per-sample output agreement."""
    cpu_files = sorted((ROOT / "bench" / "results").glob("quality_cpu_retrieval-llama*.json"))
    cpu_cfgs: dict[str, dict] = {}
    for p in cpu_files:
        try:
            d = json.loads(p.read_text())
        except Exception:
            continue
        for c in d.get("configs", []):
            cpu_cfgs.setdefault(c["name"], dict(c, _file=p.name))
    out = []
    for c in gpu.get("configs", []):
        ref = cpu_cfgs.get(c["name"])
        same = None
        if ref:
            key = lambda s: (s["task"], s["length"], s["depth"], s["seed"])  # noqa: E731
            rs = {key(s): s for s in ref.get("samples", [])}
            pairs = [(s, rs.get(key(s))) for s in c.get("samples", [])]
            pairs = [(a, b) for a, b in pairs if b is not None]
            same = (sum(a["output"] == b["output"] for a, b in pairs) / len(pairs)) if pairs else None
            # the CPU accuracy over the same samples (the GPU run may use fewer per cell)
            cpu_acc = (sum(b["correct"] for _, b in pairs) / len(pairs)) if pairs else ref.get("accuracy")
        out.append(dict(name=c["name"], speedsfi=c.get("speedsfi"), accuracy=c.get("accuracy"),
                        agreement_with_dense=c.get("agreement_with_dense"),
                        fast_retained_fraction=c.get("fast_retained_fraction"),
                        read_fraction=c.get("read_fraction"), n=len(c.get("samples", [])),
                        cpu_accuracy=(cpu_acc if ref else None), cpu_file=ref.get("_file") if ref else None,
                        same_output_as_cpu=same, per_task=c.get("per_task")))
    return {"dtype": dtype, "meta": gpu.get("meta"), "configs": out}


# ------------------------------------------------------------------------------------------------
# plot + report (CPU)
# ------------------------------------------------------------------------------------------------

def plot_perf(result: dict, path: Path) -> Path | None:
    rows = [r for r in result.get("rows", []) if r.get("tpot_ms")]
    if not rows:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover
        log(f"no plot ({exc})")
        return None
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), 3, figsize=(17, 4.4 * len(models)), squeeze=False)
    copy_rw = (result.get("env") or {}).get("copy_gbps_rw")
    for i, model in enumerate(models):
        ax, bx, cx = axes[i]
        series = sorted({(r["config"], r["mode"]) for r in rows if r["model"] == model})
        for cfg, mode in series:
            style = "-" if mode == "graph" else "--"
            sel = sorted((r for r in rows if r["model"] == model and r["config"] == cfg and r["mode"] == mode),
                         key=lambda r: r["input_len"])
            xs = [r["input_len"] for r in sel]
            ax.plot(xs, [r["tpot_ms"] for r in sel], marker="o", linestyle=style, label=f"{cfg} ({mode})")
            for r in sel:
                ax.annotate(f"x{r['batch']}", (r["input_len"], r["tpot_ms"]), textcoords="offset points",
                            xytext=(3, 3), fontsize=6)
            kv = [(r["input_len"], r.get("kv_gbps_read")) for r in sel if r.get("kv_gbps_read")]
            if kv:
                cx.plot([p[0] for p in kv], [p[1] for p in kv], marker="o", linestyle=style,
                        label=f"{cfg} ({mode}) read")
            base = reference_config(rows)
            if cfg == base:
                continue
            ref = {(r["input_len"], r["batch"]): r["tpot_ms"] for r in rows if r["model"] == model
                   and r["config"] == base and r["mode"] == mode}
            sp = [(r["input_len"], ref[(r["input_len"], r["batch"])] / r["tpot_ms"]) for r in sel
                  if (r["input_len"], r["batch"]) in ref]
            if sp:
                bx.plot([p[0] for p in sp], [p[1] for p in sp], marker="o", linestyle=style, label=f"{cfg} ({mode})")
        if copy_rw:
            cx.axhline(copy_rw, color="k", linestyle=":", linewidth=1, label=f"torch copy {copy_rw:.0f} GB/s (r+w)")
        for a in (ax, bx, cx):
            a.set_xscale("log", base=2)
            a.set_xlabel("input tokens")
            a.grid(True, alpha=0.3)
            a.legend(fontsize=7)
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"{model}: TPOT (labels: batch)", fontsize=9)
        bx.axhline(1.0, color="k", linewidth=0.8)
        bx.set_ylabel(f"TPOT speed-up over {reference_config(rows)}")
        bx.set_title(f"{model}: speed-up over {reference_config(rows)} (same mode and batch)", fontsize=9)
        cx.set_ylabel("KV GB/s actually read per decode step")
        cx.set_title(f"{model}: achieved KV bandwidth", fontsize=9)
    env = result.get("env", {})
    fig.suptitle(f"vLLM {env.get('vllm')} end to end on {env.get('gpu')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")
    return path


def merge_results(parts: list[dict]) -> dict:
    """Several runs' JSON (e.g. two device calls) into one: lists concatenated, env merged."""
    out = dict(parts[0])
    out = json.loads(json.dumps(out))
    for p in parts[1:]:
        for k in ("checks", "correctness", "rows", "failures", "workarounds", "skipped", "plan", "serving",
                  "kernels", "kernel_tables"):
            out[k] = (out.get(k) or []) + (p.get(k) or [])
        out["env"] = {**{k: v for k, v in (p.get("env") or {}).items() if v is not None},
                      **{k: v for k, v in (out.get("env") or {}).items() if v is not None}}
        for k, v in (p.get("stages") or {}).items():
            out.setdefault("stages", {})[k] = v
        if p.get("quality") and not out.get("quality"):
            out["quality"] = p["quality"]
    out["rows"] = _latest_rows(out.get("rows") or [])
    out["merged_from"] = [p.get("command") for p in parts]
    return out


def _latest_rows(rows: list[dict]) -> list[dict]:
    """One perf row per (model, config, mode, input, batch): the last measured one, else the last
    (a later call that re-runs a configuration after a fix replaces the earlier error rows; the
    failures themselves stay in ``failures``)."""
    key = lambda r: (r.get("model"), r.get("config"), r.get("mode"), r.get("input_len"), r.get("batch"))  # noqa: E731
    best: dict = {}
    for r in rows:
        k = key(r)
        if k not in best or r.get("error") is None or best[k].get("error") is not None:
            best[k] = r
    return [r for r in rows if best[key(r)] is r]


def markdown_report(result: dict) -> str:
    """Checks, perf rows, quality and every failure as markdown (for bench/README.md)."""
    out = [f"vLLM {result.get('env', {}).get('vllm')} on {result.get('env', {}).get('gpu')} "
           f"(torch {result.get('env', {}).get('torch')}, _C library {result.get('env', {}).get('c_library')}, "
           f"copy {result.get('env', {}).get('copy_gbps_rw')} GB/s r+w)", "",
           "| stage | check | result |", "|---|---|---|"]
    for c in result.get("checks", []):
        res = {True: "PASS", False: "FAIL", None: "info"}[c.get("ok")]
        det = c.get("detail")
        if isinstance(det, dict) and "first_diff" in det:
            det = f"first differing token per prompt: {det['first_diff']}"
        out.append(f"| {c.get('stage')} | {c.get('name')} | {res} {'' if det is None else str(det)[:160]} |")
    if result.get("rows"):
        out += ["", summary_table(result)]
    q = result.get("quality") or {}
    if q.get("configs"):
        out += ["", f"Quality (retrieval-llama, {q.get('dtype')}):", "",
                "| config | accuracy | CPU accuracy | same output as CPU | fast-step retained |", "|---|---|---|---|---|"]
        for c in q["configs"]:
            pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
            out.append(f"| {c['name']} | {pct(c['accuracy'])} | {pct(c.get('cpu_accuracy'))} | "
                       f"{pct(c.get('same_output_as_cpu'))} | {c.get('fast_retained_fraction')} |")
    if result.get("kernels"):
        out += ["", "Dense decode kernels (one layer, CUDA graphs): our paged_decode vs the delegate's "
                "(vLLM's Triton unified attention):", "",
                "| context | batch | paged_decode us | GB/s | delegate us | GB/s | delegate kernel | faster | error |",
                "|---|---|---|---|---|---|---|---|---|"]
        for k in result["kernels"]:
            f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            out.append(f"| {k.get('context')} | {k.get('batch')} | {f(k.get('paged_decode_us'))} | "
                       f"{f(k.get('paged_decode_gbps'))} | {f(k.get('delegate_us'))} | {f(k.get('delegate_gbps'))} | "
                       f"{k.get('delegate_kernel') or '-'} | {k.get('faster') or '-'} | {(k.get('error') or '')[:80]} |")
    for t in result.get("kernel_tables", []):
        out += ["", f"Kernels of a decode window ({t.get('config')}, input {t.get('input_len')} x "
                f"{t.get('batch')}, {t.get('profiled_steps')} steps; torch profiler): "
                f"{t.get('gpu_us_per_step')} us of GPU time and {t.get('launches_per_step')} launches per step", "",
                "| kernel | launches/step | launches/layer | us/step | longest us | share |", "|---|---|---|---|---|---|"]
        for k in t.get("kernels", [])[:25]:
            out.append(f"| `{k['kernel'][:90]}` | {k['launches_per_step']} | {k['launches_per_layer']} | "
                       f"{k['us_per_step']} | {k['longest_us']} | {k['share']} |")
    if result.get("serving"):
        out += ["", "Serving (`vllm bench serve`, random prompts at a request rate):", "",
                "| config | input | output | rate/s | prompts | output tok/s | mean TTFT ms | mean TPOT ms | error |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in result["serving"]:
            f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            out.append(f"| {r.get('config')} | {r.get('input_len')} | {r.get('output_len')} | {r.get('request_rate')} | "
                       f"{r.get('num_prompts')} | {f(r.get('output_tok_s'))} | {f(r.get('mean_ttft_ms'))} | "
                       f"{f(r.get('mean_tpot_ms'))} | {(r.get('error') or '')[:80]} |")
    if result.get("failures") or result.get("workarounds") or result.get("skipped"):
        out += ["", "| stage | job | phase | error | workaround |", "|---|---|---|---|---|"]
        for f in result.get("failures", []):
            out.append(f"| {f.get('stage')} | {f.get('job')} | {f.get('phase')} | `{str(f.get('error'))[:300]}` | "
                       f"{f.get('workaround') or ''} |")
        for sk in result.get("skipped", []):
            out.append(f"| {sk.get('stage')} | {sk.get('job')} | skipped | {sk.get('reason')} | |")
        for w in result.get("workarounds", []):
            out.append(f"| | | workaround | | {w} |")
    return "\n".join(out)


def kernel_table(events: list[dict], *, steps: int, layers: int, top: int = 40) -> dict:
    """A torch-profiler trace's GPU kernels as a table: per kernel name, launches and microseconds
    per profiled step, launches per layer, the longest launch, and the share of the window's GPU
    time. ``events``: the chrome trace's ``traceEvents``."""
    agg: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        a = agg.setdefault(str(e.get("name")), [0, 0.0, 0.0])
        d = float(e.get("dur", 0.0))
        a[0] += 1
        a[1] += d
        a[2] = max(a[2], d)
    total = sum(a[1] for a in agg.values())
    steps = max(steps, 1)
    rows = [dict(kernel=name[:160], launches_per_step=round(a[0] / steps, 2),
                 launches_per_layer=round(a[0] / steps / max(layers, 1), 3),
                 us_per_step=round(a[1] / steps, 1), longest_us=round(a[2], 1),
                 share=round(a[1] / total, 4) if total else None)
            for name, a in sorted(agg.items(), key=lambda kv: -kv[1][1])]
    return dict(gpu_us_per_step=round(total / steps, 1),
                launches_per_step=round(sum(a[0] for a in agg.values()) / steps, 1),
                kernels=rows[:top], kernels_left_out=max(len(rows) - top, 0))


def reference_config(rows: list[dict]) -> str:
    """The baseline speed-ups are taken against: vLLM's defaults when measured, else TRITON_ATTN."""
    return "vllm_default" if any(r.get("config") == "vllm_default" and r.get("tpot_ms") for r in rows) else "triton"


def summary_table(result: dict) -> str:
    rows = [r for r in result.get("rows", [])]
    base = reference_config(rows)
    lines = [f"| model | config | mode | input | batch | fit | TPOT ms | TTFT ms | out tok/s | KV GB/s (read) | "
             f"speed-up over {base} | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ref = {(r["model"], r["mode"], r["input_len"], r["batch"]): r["tpot_ms"] for r in rows
           if r["config"] == base and r.get("tpot_ms")}

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)
    for r in rows:
        base = ref.get((r["model"], r["mode"], r["input_len"], r["batch"]))
        sp = (base / r["tpot_ms"]) if (base and r.get("tpot_ms")) else None
        lines.append(f"| {r['model']} | {r['config']} | {r['mode']} | {r['input_len']} | {r['batch']} | "
                     f"{r.get('max_concurrency') or '-'} | {f(r.get('tpot_ms'))} | {f(r.get('ttft_ms'), '{:.0f}')} | "
                     f"{f(r.get('output_tok_s'), '{:.0f}')} | {f(r.get('kv_gbps'), '{:.0f}')} "
                     f"({f(r.get('kv_gbps_read'), '{:.0f}')}) | {f(sp, '{:.2f}x')} | {(r.get('error') or '')[:60]} |")
    return "\n".join(lines)


