"""Per-step thread CPU time (time.thread_time: robust to other jobs on a shared machine, unlike wall time)
of the prefill step and of each decode step, per configuration of bench_cpu_vllm (same engine settings, bf16):
the decode steps' median (the typical step: SFI's fast steps) and mean (every step, SFI's slow steps included),
and the mean of SFI's slow decode steps and of the others apart (a step is slow when it adds to ``sfi.slow_steps``).
usage: bench/bench_cpu_steps.py CONFIGS LENGTH DTYPE [PROFILE_CONFIG]   (env DECODE: decode steps, PROF_PREFILL=1,
ROWS_OUT=path: append one JSON line per request)

Thread CPU time counts the calling thread only: OMP_NUM_THREADS defaults to 1 here so that every op
(vLLM's C++ attention and oneDNN GEMMs included) runs on it and is counted. With more threads the
work of the others is missed (CPU_ATTN's 2K prefill read 2.3 s with 2 threads, 4.6 s with 1)."""
import os, sys, time, statistics, cProfile, pstats, json
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import bench_cpu_vllm as B

configs, length, dtype = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
prof_cfg = sys.argv[4] if len(sys.argv) > 4 else None
N = int(os.environ.get("DECODE", "24"))
res = {}
for name in configs:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    backend, section = B.CONFIGS[name]
    settings = dict(enforce_eager=True, dtype=dtype, max_num_seqs=4, max_model_len=8192,
                    max_num_batched_tokens=2048, block_size=32, kv_cache_memory_bytes=1 << 30,
                    enable_prefix_caching=False, attention_backend=backend, seed=0)
    if section:
        settings["additional_config"] = {"speedsfi": section}
    llm = LLM(model=os.environ.get("MODEL", os.path.join(ROOT, ".cache/real_model/SmolLM2-135M-Instruct")), **settings)
    ids = B._prompt(llm.get_tokenizer(), length).prompt_ids
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=N + 1, ignore_eos=True)
    from vllm_ext import metrics

    for rep in range(2):
        before = metrics.snapshot()
        eng.add_request(f"r{rep}", {"prompt_token_ids": ids}, sp)
        steps, slow = [], []
        prof = cProfile.Profile(time.thread_time) if (rep == 1 and name == prof_cfg) else None
        n = 0
        while eng.has_unfinished_requests():
            if prof and (n == 0 if os.environ.get("PROF_PREFILL") else n >= 2):
                prof.enable()
            s0 = metrics.snapshot().get("sfi.slow_steps", 0)
            t0 = time.thread_time()
            eng.step()
            steps.append(time.thread_time() - t0)
            slow.append(metrics.snapshot().get("sfi.slow_steps", 0) > s0)
            if prof:
                prof.disable()
            n += 1
        after = metrics.snapshot()
        sfi_steps = {k[4:]: after[k] - before.get(k, 0) for k in ("sfi.slow_steps", "sfi.fast_steps")
                     if k in after}
        pre = sum(steps[:-N]) if len(steps) > N else steps[0]
        dec, dec_slow = steps[-N + 1:], slow[-N + 1:]
        by_kind = {kind: [t for t, sl in zip(dec, dec_slow) if sl == want]
                   for kind, want in (("slow", True), ("other", False))}
        kinds = {f"decode_cpu_ms_{kind}_mean": round(1e3 * statistics.mean(ts), 1)
                 for kind, ts in by_kind.items() if ts}
        print(f"{name} rep{rep}: prefill cpu {pre:.3f}s  decode cpu median {1e3*statistics.median(dec):.1f} ms "
              f"mean {1e3*statistics.mean(dec):.1f} ms min {1e3*min(dec):.1f} ms  steps {len(steps)} {sfi_steps} "
              f"{kinds}", flush=True)
        res[name] = (pre, statistics.median(dec), statistics.mean(dec))
        if os.environ.get("ROWS_OUT"):
            with open(os.environ["ROWS_OUT"], "a") as f:
                f.write(json.dumps(dict(config=name, length=length, rep=rep, prefill_cpu_s=round(pre, 3),
                                        decode_cpu_ms_median=round(1e3 * statistics.median(dec), 1),
                                        decode_cpu_ms_mean=round(1e3 * statistics.mean(dec), 1),
                                        decode_cpu_ms_min=round(1e3 * min(dec), 1), decode_steps=len(dec),
                                        **kinds, **sfi_steps)) + "\n")
        tokens = None
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    eng.engine_core.shutdown()
    del llm, eng
    cleanup_dist_env_and_memory()
print("SUMMARY", length, dtype, "(prefill s, decode median ms, decode mean ms)",
      {k: (round(a, 3), round(1e3 * b, 1), round(1e3 * c, 1)) for k, (a, b, c) in res.items()})
