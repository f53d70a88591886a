"""Counters of the SPEEDSFI backend, per process, and their way to vLLM's ``/metrics`` endpoint.

Counters are plain host integers bumped where the host already decides something (once per layer
call or per step, never per token). Every process writes its counters to
``$SPEEDSFI_TRACE_DIR/trace-<pid>.json`` at most every ``SPEEDSFI_TRACE_INTERVAL_S`` seconds, and
once more when that interval has passed after its last bump (so an idle server's ``/metrics`` is
current). The first process that registers the plugin (the API server or the offline driver) picks
a fresh directory when none is set (1 s interval); engine cores and workers inherit it (Ray actors
too: ``vllm_ext.env_vars.forward_to_ray``). A Prometheus collector registered in every process sums the directory on
scrape, so vLLM's own ``/metrics`` shows ``speedsfi_events_total{event=...}``. Tests and the demo set
the directory and an interval of 0 to read exact counts.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter

from vllm_ext import env_vars

COUNTS: Counter = Counter()
_lock = threading.Lock()
_last_flush = 0.0
_dirty = False
_flush_lock = threading.Lock()
_wake = threading.Event()
_flusher_pid = None                      # the process whose flusher thread runs (threads do not fork)
_last_log = time.monotonic()
_providers: dict[str, "callable"] = {}
_logged_once: set[str] = set()
logger = logging.getLogger("vllm_ext")


def bump(key: str, n: int = 1) -> None:
    with _lock:
        COUNTS[key] += n
    _maybe_flush()
    _maybe_log()


def add_provider(name: str, fn) -> None:
    """``fn() -> dict[str, int]``: counters kept elsewhere (e.g. on the device), merged into
    ``snapshot()``. Reading device counters synchronises, so it happens only when counters are
    flushed (at most every ``SPEEDSFI_TRACE_INTERVAL_S``) or logged, never per step."""
    _providers[name] = fn


def snapshot() -> dict[str, int]:
    with _lock:
        out = dict(COUNTS)
    for fn in list(_providers.values()):
        out.update(fn())
    return out


def summary(counts: dict[str, int]) -> str:
    slow, fast = counts.get("sfi.slow_steps", 0), counts.get("sfi.fast_steps", 0)
    ctx = counts.get("sfi.fast_context_tokens", 0)
    retained = counts.get("sfi.fast_retained_tokens", 0) / ctx if ctx else float("nan")
    fallbacks = {k[9:]: v for k, v in counts.items() if k.startswith("fallback.")}
    cand = counts.get("critiprefill.key_blocks_candidate", 0)
    cp = (f"; CritiPrefill sparse prefill tokens {counts.get('critiprefill.prefill_tokens', 0)}, key "
          f"blocks skipped {counts.get('critiprefill.key_blocks_skipped', 0)} of {cand}"
          if "critiprefill.key_blocks_candidate" in counts else "")
    return (f"SFI slow steps {slow}, fast steps {fast}, dense decode rows "
            f"{counts.get('sfi.dense_rows', 0)}, mean retained fraction {retained:.3f}{cp}; "
            f"fallbacks {fallbacks or 'none'}")


def _maybe_log() -> None:
    global _last_log
    now = time.monotonic()
    if not _providers or now - _last_log < float(env_vars.get(env_vars.LOG_INTERVAL_S, "30")):
        return
    _last_log = now
    logger.info("vllm_ext: %s", summary(snapshot()))


def reset() -> None:
    with _lock:
        COUNTS.clear()
    _providers.clear()


def fallback(key: str, message: str, *args) -> None:
    """Count a fallback and log it once per process and key (never silently degrade)."""
    bump(f"fallback.{key}")
    if key not in _logged_once:
        _logged_once.add(key)
        logger.warning("vllm_ext fallback [%s]: " + message, key, *args)


def log_once(key: str, message: str, *args) -> None:
    if key not in _logged_once:
        _logged_once.add(key)
        logger.info(message, *args)


def _maybe_flush() -> None:
    """Write this process's counters now, or, when the last write is younger than the interval,
    once the interval has passed (a trailing write): the counters a request bumps last, e.g. as its
    slots are released after its last token, reach ``/metrics`` within one interval although no
    further step may come."""
    global _dirty
    trace_dir = env_vars.get(env_vars.TRACE_DIR)
    if not trace_dir:
        return
    _dirty = True
    wait = _flush_interval() - (time.monotonic() - _last_flush)
    if wait <= 0:
        _flush(trace_dir)
    else:
        _trailing_flush_soon()


def _flush_interval() -> float:
    return float(env_vars.get(env_vars.TRACE_INTERVAL_S, "0"))


def _flush(trace_dir: str) -> None:
    global _dirty, _last_flush
    with _flush_lock:
        _last_flush = time.monotonic()
        _dirty = False                   # a bump during the snapshot makes it dirty again
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, f"trace-{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(snapshot(), f)
        os.replace(tmp, path)


def _trailing_flush_soon() -> None:
    """Wake this process's flusher thread (started on first use, again after a fork)."""
    global _flusher_pid
    if _flusher_pid != os.getpid():
        _flusher_pid = os.getpid()
        _wake.clear()
        threading.Thread(target=_flusher, name="vllm_ext-metrics-flush", daemon=True).start()
    _wake.set()


def _flusher() -> None:
    while True:
        _wake.wait()
        _wake.clear()
        wait = _flush_interval() - (time.monotonic() - _last_flush)
        if wait > 0:
            time.sleep(wait)
        trace_dir = env_vars.get(env_vars.TRACE_DIR)
        if _dirty and trace_dir:
            try:
                _flush(trace_dir)
            except OSError as e:         # the directory went away (tests, shutdown): say so once
                log_once("metrics_flush", "vllm_ext: could not write the counters: %s", e)


def ensure_trace_dir() -> str:
    """Give this process tree a counters directory unless one is set (inherited by children)."""
    d = env_vars.get(env_vars.TRACE_DIR)
    if not d:
        import tempfile

        d = tempfile.mkdtemp(prefix="vllm_ext-stats-")
        os.environ[env_vars.TRACE_DIR] = d
        if env_vars.get(env_vars.TRACE_INTERVAL_S) is None:
            os.environ[env_vars.TRACE_INTERVAL_S] = "1"
    return d


def totals(trace_dir: str | None = None) -> dict[str, int]:
    """Counters summed over every process writing to ``trace_dir`` (this one included)."""
    trace_dir = trace_dir or env_vars.get(env_vars.TRACE_DIR)
    merged: Counter = Counter()
    traces = read_traces(trace_dir) if trace_dir else {}
    traces[os.getpid()] = snapshot()
    for counts in traces.values():
        merged.update(counts)
    return dict(merged)


_HIST_PREFIX = "sfi.fast_retained_fraction_le_"
_HIST_SUM = "sfi.fast_retained_fraction_sum_ppm"
# counters also exported under their own names, with units (Prometheus conventions)
_NAMED_COUNTERS = (
    ("sfi.fast_retained_tokens", "speedsfi_sfi_fast_retained_tokens",
     "KV tokens read by SFI fast decode steps (per row and step)"),
    ("sfi.fast_context_tokens", "speedsfi_sfi_fast_context_tokens",
     "context tokens of the rows on SFI fast decode steps (retained / context = retained fraction)"),
    ("speed.blocks_saved", "speedsfi_speed_kv_blocks_saved",
     "upper-layer KV blocks SPEED never allocated (interior prompt blocks)"),
    ("speed.upper_tokens_skipped", "speedsfi_speed_upper_layer_tokens_skipped",
     "prompt tokens that skipped the layers at and above l_cut"),
    ("critiprefill.prefill_tokens", "speedsfi_critiprefill_prefill_tokens",
     "prompt tokens prefilled block-sparsely by CritiPrefill"),
)


def prometheus_families(counts: dict[str, int]):
    """The metric families of ``counts`` (every process's counters summed):

    * ``speedsfi_events_total{event}``: every counter (fallbacks, steps, slots, ...);
    * ``speedsfi_sfi_slots_in_use`` / ``speedsfi_request_slots_in_use``: gauges (assigned - released);
    * ``speedsfi_sfi_fast_retained_fraction``: histogram of retained / context tokens per fast row-step
      (buckets 1, 2, 5, 10, 20, 50 %, +Inf = the fast row-steps), from the device counters;
    * the main token and block counters under their own names (``*_tokens_total``, ``*_blocks_total``).
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    events = CounterMetricFamily("speedsfi_events", "SPEEDSFI backend events (vllm_ext)", labels=["event"])
    for key, value in sorted(counts.items()):
        if not key.startswith(_HIST_PREFIX) and key != _HIST_SUM:
            events.add_metric([key], value)
    yield events
    yield GaugeMetricFamily("speedsfi_request_slots_in_use", "requests holding a SPEEDSFI request slot",
                            value=counts.get("slots.acquired", 0) - counts.get("slots.released", 0))
    yield GaugeMetricFamily("speedsfi_sfi_slots_in_use",
                            "requests holding an SFI compact-segment slot (at most sfi.max_requests)",
                            value=counts.get("sfi.slots_assigned", 0) - counts.get("sfi.slots_released", 0))
    for key, name, doc in _NAMED_COUNTERS:
        if key in counts:
            yield CounterMetricFamily(name, doc, value=counts[key])
    bounds = sorted((int(k[len(_HIST_PREFIX):-3]), v) for k, v in counts.items() if k.startswith(_HIST_PREFIX))
    if bounds:
        buckets = [(f"{pct / 100:g}", v) for pct, v in bounds] + [("+Inf", counts.get("sfi.fast_steps", 0))]
        yield HistogramMetricFamily(
            "speedsfi_sfi_fast_retained_fraction",
            "retained / context tokens of each row on an SFI fast decode step", buckets=buckets,
            sum_value=counts.get(_HIST_SUM, 0) / 1e6)


class PrometheusCollector:
    """SPEEDSFI's metrics on vLLM's ``/metrics``, summed over the engine's processes on each scrape."""

    def collect(self):
        yield from prometheus_families(totals())


_collector_registered = False


def register_prometheus_collector() -> None:
    global _collector_registered
    if _collector_registered:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    REGISTRY.register(PrometheusCollector())
    _collector_registered = True


def read_traces(trace_dir: str) -> dict[int, dict[str, int]]:
    """All processes' counters in ``trace_dir``: pid -> counters."""
    out = {}
    if not os.path.isdir(trace_dir):
        return out
    for name in os.listdir(trace_dir):
        if name.startswith("trace-") and name.endswith(".json"):
            with open(os.path.join(trace_dir, name)) as f:
                out[int(name[6:-5])] = json.load(f)
    return out
