"""The GPU driver's job runner (bench/vllm_e2e.py): every job in its own subprocess (process group,
log file), killed when it outlives its own estimate x ``e2e_timing.HANG_FACTOR`` or the call's
deadline; a failure is recorded with its exact error and the run goes on; the result JSON is
rewritten after every job, so a call stopped at any point leaves what it measured. No vLLM, no
torch: the stages (``e2e_stages``) subclass :class:`JobRunner` with one ``job_<kind>`` per job kind."""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from e2e_timing import hang_timeout

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "bench" / "vllm_e2e.py"
SCHEMA = 2
JSON_NAME = "vllm_e2e.json"
PNG_NAME = "vllm_e2e.png"
LOGS_TAR = "vllm_e2e_logs.tar.gz"
STATE_FILE = os.environ.get("VLLM_E2E_STATE", "/tmp/vllm_e2e_state.json")
SAFETY_S = 10.0                   # a job's kill time stays this far before the call's deadline


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def log(msg: str) -> None:
    print(f"[vllm_e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def short_error(text: str, limit: int = 600) -> str:
    """The most telling line(s) of a traceback / log tail: the last exception line."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    pat = re.compile(r"(Error|Exception|error:|FAILED|Traceback|Killed|out of memory|CUDA)")
    for ln in reversed(lines):
        if pat.search(ln) and not ln.lstrip().startswith("File "):
            return ln.strip()[:limit]
    return (lines[-1].strip() if lines else "")[:limit]


C_OP_PATTERN = re.compile(r"_C_stable|torch\.ops\._C|_C::|_C\.|no kernel image|cudaErrorNoKernelImage|"
                          r"undefined symbol|_custom_ops|rms_norm|silu_and_mul|rotary_embedding")


def looks_like_c_op_failure(text: str) -> bool:
    """Does the exception line of ``text`` (a traceback or log) point at vLLM's ``_C`` kernels?
    Only the final error line is matched: frames of a traceback name rms_norm & co. whatever failed."""
    return bool(C_OP_PATTERN.search(short_error(text or "")))




def spawn(argv: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None,
          cwd: str | Path = ROOT) -> tuple[int | None, str, float]:
    """Run ``argv`` with its output appended to ``log_path``; at ``timeout`` s its whole process group
    gets SIGTERM, then SIGKILL after 15 s. Returns (exit status, or None when killed; the log text;
    seconds)."""
    t = time.monotonic()
    with open(log_path, "ab") as fo:
        fo.write(f"$ {' '.join(argv)}\n".encode())
        fo.flush()
        proc = subprocess.Popen(argv, stdout=fo, stderr=subprocess.STDOUT, cwd=str(cwd), env=env,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = None
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
            except Exception:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except Exception:
                    pass
                proc.wait()
            fo.write(f"\n[vllm_e2e] killed after {timeout:.0f} s (timeout)\n".encode())
    return rc, Path(log_path).read_text(errors="replace"), time.monotonic() - t


def job_timeout(job: dict, remaining_s: float) -> float:
    """A job's kill time: its estimate x HANG_FACTOR (a job that runs that long is taken as hung),
    and never past the call's deadline."""
    return min(hang_timeout(job["est_s"]), remaining_s - SAFETY_S)


class JobRunner:
    """Runs a plan (a list of job dicts: ``stage``, ``kind``, ``name``, ``est_s``, ``min_s``) against
    the call's deadline, each job through ``self.job_<kind>(job, timeout)``."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="vllm_e2e_"))
        self.logdir = self.work / "logs"
        self.logdir.mkdir()
        self.state = self._load_state()
        if getattr(args, "custom_ops", "auto") == "none":
            self.state["custom_ops_none"] = True
        self.result: dict[str, Any] = {
            "schema": SCHEMA, "tool": "bench/vllm_e2e.py", "command": " ".join(sys.argv),
            "started_utc": now_utc(), "env": {"gpu": None, "vllm": None, "torch": None},
            "stages": {}, "checks": [], "correctness": [], "rows": [], "quality": None, "serving": [],
            "kernel_tables": [],
            "kernels": [], "failures": [], "workarounds": [], "skipped": [], "plan": [],
        }
        self._env_from_payload()

    # -- state shared by the calls of one warm machine (custom ops fallback) --
    def _load_state(self) -> dict:
        try:
            with open(STATE_FILE) as f:
                return json.load(f)
        except Exception:
            return {}

    def _save_state(self) -> None:
        try:
            with open(STATE_FILE, "w") as f:
                json.dump(self.state, f)
        except OSError:
            pass

    def _env_from_payload(self) -> None:
        env = self.result["env"]
        env.update(python=platform.python_version(), host=platform.node(), cpu_build=self.args.cpu)
        site = os.environ.get("VLLM_SITE", "/tmp/vllm_site")
        try:
            with open(os.path.join(site, ".speedsfi_payload.json")) as f:
                p = json.load(f)
            env.update(vllm=p.get("vllm"), c_library=p.get("so_variant"), payload_site=site)
        except Exception:
            pass

    def remaining(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # -- output --
    def write(self) -> None:
        self.result["updated_utc"] = now_utc()
        self.result["wall_s"] = round(self.elapsed(), 1)
        tmp = self.out / (JSON_NAME + ".part")
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(tmp, self.out / JSON_NAME)
        try:
            with tarfile.open(self.out / (LOGS_TAR + ".part"), "w:gz") as tf:
                tf.add(self.logdir, arcname="vllm_e2e_logs")
            os.replace(self.out / (LOGS_TAR + ".part"), self.out / LOGS_TAR)
        except Exception as exc:  # pragma: no cover
            log(f"could not pack the logs: {exc}")

    def failure(self, stage: str, job: str, phase: str, error: str, **kw) -> None:
        rec = dict(stage=stage, job=job, phase=phase, error=error, **kw)
        self.result["failures"].append(rec)
        log(f"FAILED {job} ({phase}): {error}")

    def check(self, stage: str, name: str, ok: bool | None, detail: Any = None) -> None:
        self.result["checks"].append(dict(stage=stage, name=name, ok=ok, detail=detail))
        log(f"check [{stage}] {name}: {'PASS' if ok else ('n/a' if ok is None else 'FAIL')}"
            + (f" ({detail})" if detail is not None and not isinstance(detail, (dict, list)) else ""))

    # -- subprocesses --
    def child_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        pp = [str(ROOT), str(ROOT / "bench")]
        site = os.environ.get("VLLM_SITE")
        if site and os.path.isdir(site):
            pp.insert(0, site)
        pp += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in pp]
        env["PYTHONPATH"] = os.pathsep.join(pp)
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1",
                   TOKENIZERS_PARALLELISM="false", SPEEDSFI_TRACE_INTERVAL_S="0",
                   SPEEDSFI_LOG_INTERVAL_S="600",
                   # the GPU image has no FlashInfer; vLLM's sampler imports it unless told not to
                   # (found on the H100: "ModuleNotFoundError: No module named 'flashinfer'" from
                   # TopKTopPSampler.__init__ -> flashinfer_sampler_supported)
                   VLLM_USE_FLASHINFER_SAMPLER="0")
        if self.args.cpu:
            env.update(SPEEDSFI_FORCE_TORCH_KERNELS="1", VLLM_CPU_KVCACHE_SPACE="1",
                       VLLM_CPU_OMP_THREADS_BIND="nobind")
            env.pop("TRITON_INTERPRET", None)
        env.update(extra or {})
        return env

    def log_path(self, name: str) -> Path:
        return self.logdir / (re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ".log")

    def spawn(self, name: str, argv: list[str], timeout: float, env: dict[str, str]
              ) -> tuple[int | None, str, float]:
        """Run ``argv`` with output to logs/<name>.log; kill its process group at ``timeout``."""
        return spawn(argv, self.log_path(name), timeout, env)

    def worker(self, job: dict, timeout: float, spec_extra: dict | None = None,
               env_extra: dict[str, str] | None = None) -> tuple[int | None, list[dict], str, float]:
        """``bench/vllm_e2e.py _worker`` on the job's spec: (exit status, events, log text, seconds)."""
        spec = dict(job, **(spec_extra or {}))
        spec["cpu"] = self.args.cpu
        spec["events"] = str(self.work / f"events_{abs(hash(job['name'] + str(time.time())))}.jsonl")
        spec["trace_dir"] = tempfile.mkdtemp(prefix="trace_", dir=self.work)
        self.prepare_spec(job, spec)
        spec_path = self.work / f"spec_{abs(hash(spec['events']))}.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(env_extra or {})
        env["SPEEDSFI_TRACE_DIR"] = spec["trace_dir"]
        argv = [sys.executable, str(DRIVER), "_worker", "--spec", str(spec_path)]
        rc, text, secs = self.spawn(job["name"], argv, timeout, self.child_env(env))
        events = []
        if os.path.isfile(spec["events"]):
            with open(spec["events"]) as f:
                for line in f:
                    try:
                        events.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
        return rc, events, text, secs

    def prepare_spec(self, job: dict, spec: dict) -> None:
        """Stage-specific fields of a worker's spec (overridden by the stages)."""

    # -- the loop --
    def run_jobs(self, jobs: list[dict]) -> None:
        self.result["plan"] = [{k: v for k, v in j.items() if k not in ("groups",)} | (
            {"groups": j["groups"]} if "groups" in j else {}) for j in jobs]
        self.write()
        stage_t: dict[str, float] = {}
        for j in jobs:
            st = j["stage"]
            self.result["stages"].setdefault(st, {"jobs": 0, "wall_s": 0.0, "skipped": 0})
            rem = self.remaining()
            if rem < j["min_s"]:
                why = f"deadline: {rem:.0f} s left, the job needs at least {j['min_s']} s"
                self.result["skipped"].append(dict(stage=st, job=j["name"], reason=why))
                self.result["stages"][st]["skipped"] += 1
                log(f"SKIP {j['name']}: {why}")
                self.on_skip(j, why)
                self.write()
                continue
            timeout = job_timeout(j, rem)
            log(f"[{st}] {j['name']} (killed at {timeout:.0f} s = min(estimate {j['est_s']:.0f} s x 1.5, "
                f"deadline); {self.elapsed():.0f} s elapsed, {rem:.0f} s left)")
            t = time.monotonic()
            try:
                getattr(self, f"job_{j['kind']}")(j, timeout)
            except Exception:
                self.failure(st, j["name"], "driver", traceback.format_exc().strip().splitlines()[-1],
                             traceback=traceback.format_exc()[-3000:])
            dt = time.monotonic() - t
            self.result["stages"][st]["jobs"] += 1
            self.result["stages"][st]["wall_s"] = round(self.result["stages"][st]["wall_s"] + dt, 1)
            stage_t[st] = stage_t.get(st, 0.0) + dt
            log(f"[{st}] {j['name']} took {dt:.0f} s (estimate {j['est_s']:.0f} s; stage {st} so far "
                f"{stage_t[st]:.0f} s)")
            self.after_job(j)
            self.write()
        self.stage_times = stage_t

    def on_skip(self, job: dict, why: str) -> None:
        """What a skipped job leaves in the result (overridden by the stages)."""

    def after_job(self, job: dict) -> None:
        """Derived checks / plots after each job (overridden by the stages)."""

    def job_fake(self, j: dict, timeout: float) -> None:
        """A stand-in job (tests of the runner): ``sleep_s`` seconds in a subprocess."""
        rc, text, secs = self.spawn(j["name"], [sys.executable, "-c",
                                                f"import time; time.sleep({float(j['sleep_s'])})"],
                                    timeout, self.child_env())
        if rc is None:
            self.failure(j["stage"], j["name"], "timeout",
                         f"killed after {timeout:.0f} s (estimate {j['est_s']:.0f} s x 1.5 / deadline)")
        elif rc != 0:
            self.failure(j["stage"], j["name"], "crash", short_error(text) or f"exit status {rc}")
