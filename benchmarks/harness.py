"""Benchmark harness: rpcompile side by side with its peers, each system in its own process.

    python -m benchmarks.harness --model qwen3-1.7b --gpus 1 --seq-len 2048 \\
        --tokens-per-step 65536 --microbatches 4 --steps 5 --warmup 2 \\
        --systems rpcompile,eager,roundpipe,fsdp2 --out benchmarks/RESULTS.md \\
        --json $OUT/results.json --timeout 240 --budget 540

Every system runs in a child process (`python -m benchmarks.child`) with CUDA_VISIBLE_DEVICES
set to the GPUs asked for, a time limit, and a watchdog on its host memory. Whatever happens to
a child (failure, out-of-memory, timeout, a crash that takes the process down), the harness
records it with the tail of its stderr and goes on; the JSON and the markdown section are
rewritten after every system, so an interrupted run still leaves its results.

--loss-steps N is the loss-parity mode: every system trains the same initial model (same seed)
on the same batches with the same AdamW for N optimizer steps, no warm-up (step 1 is the first),
and the section compares each system's loss at every step with eager's.

--max-seq-search finds, per system, the longest single sequence that trains under a per-GPU
memory cap (24 GiB by default), doubling and then bisecting in steps of 1,024 inside one child;
a child that dies on a probe is restarted with what it had established.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from . import bar, report, run_files
from .common import (LR, MODELS, GiB, PEAK_FLOPS_PER_GPU, RunSpec, get_model, next_probe, param_count, read_result,
                     utilisation)
from .systems import get_system

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RP_SITE = os.path.expanduser("~/.cache/rpcompile-bench/rp_site")   # setup_device.sh's default
BASE_PROCESS_BYTES = 3 * GiB        # CUDA context, libraries, allocator slack per process
HOST_GUARD = 0.93                   # kill a child whose process group passes this share of RAM
DEFAULT_WARMUP = 2
MAX_ROTATION_WARMUP = 8             # the most GPUs of one host here
LOSS_RTOL = 2.0**-7                 # see report.loss_parity


def default_warmup(name: str, gpus: int, given: Optional[int] = None) -> int:
    """Warm-up steps of a system: --warmup when given, else DEFAULT_WARMUP, and for systems whose
    stage jobs rotate over the GPUs (rpcompile) at least one step per GPU.

    Note [warm-up covers every (stage, GPU) pair]: rpcompile hands stage job k of step s to GPU
    (s·J + k) mod N (J stage jobs, N GPUs), and a stage's Inductor code compiles for a GPU the
    first time the stage runs there. Over steps 0..N-1 the offsets s·J mod N take every value
    they will ever take (N / gcd(J, N) distinct ones; all N when J mod N != 0), so N warm-up
    steps leave no compilation in the timed steps. J is known only after the first step, so the
    default takes N, capped at MAX_ROTATION_WARMUP."""
    if given is not None:
        return given
    if get_system(name).rotates_over_gpus:
        return max(DEFAULT_WARMUP, min(gpus, MAX_ROTATION_WARMUP))
    return DEFAULT_WARMUP


# --- command line -------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", help=", ".join(k for k, m in MODELS.items() if k == m.name))
    p.add_argument("--gpus", type=int, default=1, help="GPUs per system (CPU mode: rpcompile's CPU devices)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--tokens-per-step", type=int, default=65536)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed optimizer steps first (compilation); default {DEFAULT_WARMUP}, and for rpcompile "
                        f"systems at least one per GPU (at most {MAX_ROTATION_WARMUP}): see default_warmup")
    p.add_argument("--systems", default="rpcompile,eager,roundpipe,fsdp2")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"),
                   help="markdown file the section is appended to ('' for none)")
    p.add_argument("--json", default="", help="JSON file the run is appended to (a list of runs)")
    p.add_argument("--record", nargs="?", const=run_files.DEFAULT_DIR, default="", metavar="DIR",
                   help="also keep the run as its own file in DIR (default benchmarks/runs/), named by UTC time, "
                        "card, GPU count and model, for `python -m benchmarks.bar`; with --render, every run of "
                        "the JSON file")
    p.add_argument("--timeout", type=float, default=240, help="seconds per system")
    p.add_argument("--budget", type=float, default=0, help="seconds for the whole invocation (0: no limit)")
    p.add_argument("--log-dir", default="", help="children's stdout/stderr (default: next to --json, else a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=LR, help="AdamW learning rate of every system")
    p.add_argument("--loss-steps", type=int, default=0, metavar="N",
                   help="loss-parity mode: N optimizer steps from step 1 (no warm-up), every step's loss compared")
    p.add_argument("--loss-reference", default="eager", help="the system the others' losses are compared with")
    p.add_argument("--loss-rtol", type=float, default=LOSS_RTOL,
                   help="loss parity holds when |loss - reference loss| <= rtol * |reference loss| at every step "
                        "(default 2^-7: two units of bf16 rounding)")
    p.add_argument("--rp-site", default=os.environ.get("RP_SITE", DEFAULT_RP_SITE),
                   help="where setup_device.sh installed RoundPipe and transformers 4.57")
    p.add_argument("--no-fit-check", action="store_true",
                   help="run systems even where the memory estimate says they cannot fit")
    p.add_argument("--max-seq-search", action="store_true")
    p.add_argument("--mem-cap-gib", type=float, default=24.0)
    p.add_argument("--maxseq-start", type=int, default=4096)
    p.add_argument("--maxseq-limit", type=int, default=262144)
    p.add_argument("--maxseq-step", type=int, default=1024, help="the bisection's resolution in tokens")
    p.add_argument("--probe-timeout", type=float, default=150, help="seconds one max-seq probe may take")
    p.add_argument("--pss-interval", type=float, default=0,
                   help="seconds between readings of the run's proportional set size, reported beside the "
                        "resident bytes (0: never; /proc/PID/smaps_rollup walks the child's page tables under "
                        "its mmap lock, which slows the run: Note [host memory without a walk])")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to the runners in RunSpec.options (e.g. roundpipe_strict_adam=1)")
    p.add_argument("--render", default="", help="only append the runs of this JSON file to --out")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [o for o in args.option if "=" not in o]
    if bad:
        p.error(f"--option takes KEY=VALUE, got {bad}")
    args.options = dict(o.split("=", 1) for o in args.option)
    for s in args.systems:
        get_system(s)
    get_model(args.model)
    if args.loss_steps < 0 or (args.loss_steps and args.max_seq_search):
        p.error("--loss-steps takes N >= 1 and does not go with --max-seq-search")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup takes N >= 0")
    if not args.render and not args.max_seq_search:
        n_seqs = args.tokens_per_step // args.seq_len
        if n_seqs < 1 or n_seqs % args.gpus:
            p.error(f"--tokens-per-step {args.tokens_per_step} must be a multiple of --seq-len {args.seq_len} "
                    f"times --gpus {args.gpus} (each GPU's process in FSDP2 takes whole sequences)")
    return args


# --- the machine --------------------------------------------------------------------------
_GPU_PROBE = ("import json, torch\n"
              "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
              "print(json.dumps({'count': n, 'names': [torch.cuda.get_device_name(i) for i in range(n)],"
              " 'total': [torch.cuda.get_device_properties(i).total_memory for i in range(n)],"
              " 'torch': torch.__version__, 'cuda': torch.version.cuda}))\n")


def probe_machine(device: str) -> dict:
    """GPUs (asked of torch in a throw-away process, so this one holds no CUDA context) and host."""
    env = {"cpu_count": os.cpu_count(), "host_mem_bytes": host_mem_total(), "python": sys.version.split()[0],
           "transparent_hugepage": transparent_hugepage()}
    if device != "cuda":
        import torch
        env.update(count=0, names=[], total=[], torch=torch.__version__, cuda=None)
        return env
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=120)
        env.update(json.loads(out.stdout.strip().splitlines()[-1]))
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        env.update(count=0, names=[], total=[], torch="?", probe_error=f"{type(e).__name__}: {e}")
    return env


def _kb_fields(path: str) -> dict:
    """The "Name: N kB" lines of a /proc file, in bytes by name; {} where it cannot be read."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if rest.strip().endswith("kB"):
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def meminfo() -> dict:
    """/proc/meminfo's sizes in bytes (empty where there is none)."""
    return _kb_fields("/proc/meminfo")


CPU_KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def host_cpu_seconds() -> dict:
    """The host's CPU seconds so far by kind, all its cores together (/proc/stat's first line;
    steal: time a virtual machine's cores ran something else); {} where there is none."""
    try:
        with open("/proc/stat") as f:
            values = f.readline().split()[1:1 + len(CPU_KINDS)]
        hz = os.sysconf("SC_CLK_TCK")
        return {k: int(v) / hz for k, v in zip(CPU_KINDS, values)}
    except (OSError, ValueError):
        return {}


def _cpu_between(a: dict, b: dict):
    """The host's CPU seconds by kind from reading a to reading b; None where either is missing."""
    return {k: round(b[k] - a[k], 1) for k in b if k in a} if a and b else None


def transparent_hugepage() -> dict:
    """The kernel's transparent huge page settings (enabled, defrag, shmem_enabled: the bracketed
    choice of each), where it says (Note [a run's start])."""
    out = {}
    for key in ("enabled", "defrag", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{key}") as f:
                text = f.read()
        except OSError:
            continue
        chosen = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
        out[key] = chosen[0] if chosen else text.strip()
    return out


def host_mem_total() -> int:
    return meminfo().get("MemTotal", 0)


def host_used(m: dict = None) -> int:
    """Memory in use on the host (MemTotal - MemAvailable; of a meminfo() reading if given):
    pinned pages included, which a process's RSS may not show (cudaHostAlloc maps them through
    the driver)."""
    m = meminfo() if m is None else m
    return m.get("MemTotal", 0) - m.get("MemAvailable", 0)


def _rollup(pid: str) -> dict:
    """A process's /proc/PID/smaps_rollup in bytes by name ("Pss", "Pss_Anon", "Anonymous", ...);
    {} where the kernel does not say. Walks its page tables (Note [host memory without a walk])."""
    return _kb_fields(f"/proc/{pid}/smaps_rollup")


def _pss(pid: str):
    """Proportional set size of a process (shared pages divided among the processes mapping
    them), or None where the kernel does not say. Walks its page tables: see group_rss."""
    return _rollup(pid).get("Pss")


def _resident(pid: str):
    """(anonymous, file, shared-memory) resident bytes of a process from the kernel's counters
    (/proc/PID/status: no page-table walk); all of VmRSS as anonymous where the kernel does not
    split it (before Linux 4.5); None where it says nothing."""
    out = _kb_fields(f"/proc/{pid}/status")
    if all(k in out for k in ("RssAnon", "RssFile", "RssShmem")):
        return out["RssAnon"], out["RssFile"], out["RssShmem"]
    return (out["VmRSS"], 0, 0) if "VmRSS" in out else None


def group_pids(pgid: int) -> list:
    """The live processes of process group `pgid` (a child and what it spawned), as /proc names.
    A zombie is left out: a child killed stays one until the harness waits for it, and kill_group
    waited its whole grace for it after every timeout."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[2]) == pgid and rest[0] != "Z":
            pids.append(name)
    return pids


# Note [host memory without a walk]: the run's resident memory is read from the kernel's
# counters, every poll. Its proportional set size (/proc/PID/smaps_rollup) walks each process's
# page tables under its mmap lock, which holds the process's mmap and munmap calls (a malloc
# of a large temporary, a Python arena, a thread's stack) meanwhile: read every 0.5 s it slowed
# rpcompile's Llama-3.1-8B steps by a fifth (seventeenth session), and read every 5 s the walks of
# a 2-H200 Llama-3.1-8B run (a 136 GiB main process, two workers) still took the harness ~2 CPU-s
# of each 5 (top, 44th session): one process's page tables or another's were walked 40% of the
# run. Here a 64 MiB allocate-and-touch loop ran 9x slower beside back-to-back walks of its
# process. The counters say, per process, anonymous, file and shared-memory pages. The
# processes of a run map the same libraries, and the workers map the main process's shared
# files, so the group counts each process's anonymous pages and the file and shared-memory pages
# of the process that maps the most of each: a CPU run in worker processes (Qwen3 shape, 166M
# parameters, delayed AdamW, three processes) read 6.08 GiB so against 6.18 GiB of proportional
# set size (6.26 GiB with every process's file pages counted: on a GPU host each process also
# maps CUDA's libraries, which PSS shares among them). --pss-interval still walks, to compare.
#
# Note [forked processes' anonymous pages]: a forked process shares its parent's anonymous
# pages until either writes them, and its counters count them all as its own. Inductor's
# compile pools are forked (a sidecar per compiling process, and its workers forked from it):
# on 2 H200s with Qwen3-1.7B (45th session) the counters read 36.5 GiB as 37 processes lived,
# where the host's used memory had grown 27.2 GiB. So a process with less than SMALL_ANON of
# anonymous pages is walked too, at most every SHARE_EVERY_S, for the part of them its
# proportional set size holds (Pss_Anon / Anonymous): its page tables are small (~5 ms a walk
# for a 0.5 GiB interpreter here), and the large processes (the run's main process and
# workers, whose walks the note above is about) are never walked.
SMALL_ANON = 2 * GiB
SHARE_EVERY_S = 2.0
_anon_share: dict = {}          # pid -> (when walked, its Pss_Anon / Anonymous then)


def _own_anon_share(pid: str, now: float) -> float:
    """The part of process `pid`'s anonymous pages that is its own (shared ones divided among
    the processes mapping them), walked at most every SHARE_EVERY_S; 1 where the kernel does not
    say (Note [forked processes' anonymous pages])."""
    seen = _anon_share.get(pid)
    if seen is not None and now - seen[0] < SHARE_EVERY_S:
        return seen[1]
    rollup = _rollup(pid)
    share = rollup["Pss_Anon"] / rollup["Anonymous"] if rollup.get("Anonymous") and "Pss_Anon" in rollup else 1.0
    _anon_share[pid] = (now, min(1.0, share))
    return _anon_share[pid][1]


def group_resident(pgid: int) -> dict:
    """Resident bytes of process group `pgid` by kind, from the kernel's counters (Note [host
    memory without a walk]): every process's anonymous pages (a small process's own part only:
    Note [forked processes' anonymous pages]), the largest file and shared-memory resident sizes
    any one of them has (they map the same libraries and shared files), and how many processes
    it has (Inductor's compile pools count while they live)."""
    out = {"anon": 0, "files": 0, "shmem": 0, "processes": 0}
    now, names = time.monotonic(), group_pids(pgid)
    for gone in set(_anon_share) - set(names):
        del _anon_share[gone]
    for name in names:
        r = _resident(name)
        if r is not None:
            out["anon"] += r[0] if r[0] >= SMALL_ANON else int(r[0] * _own_anon_share(name, now))
            out["files"], out["shmem"] = max(out["files"], r[1]), max(out["shmem"], r[2])
            out["processes"] += 1
    return out


def group_rss(pgid: int) -> int:
    """Resident bytes of process group `pgid` (group_resident's anonymous, file and shared)."""
    r = group_resident(pgid)
    return r["anon"] + r["files"] + r["shmem"]


def group_pss(pgid: int) -> int:
    """Proportional set size of process group `pgid`: memory its processes share counted once.
    Walks every process's page tables (Note [host memory without a walk]); resident set sizes
    where PSS is unknown."""
    total = 0
    for name in group_pids(pgid):
        pss = _pss(name)
        if pss is None:
            r = _resident(name)
            pss = sum(r) if r is not None else 0
        total += pss
    return total


def kill_group(pgid: int, grace: float = 5.0) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    t = time.time()
    while time.time() - t < grace and group_pids(pgid):
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# --- one child ----------------------------------------------------------------------------
class Harness:
    def __init__(self, args):
        self.args = args
        self.spec = get_model(args.model)
        self.n_params = param_count(self.spec)
        self.t0 = time.time()
        self.started = _dt.datetime.now(_dt.timezone.utc)
        self.date = self.started.strftime("%Y-%m-%d %H:%M UTC")
        self.deadline = self.t0 + args.budget if args.budget > 0 else None
        json_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else None
        self.log_dir = args.log_dir or (os.path.join(json_dir, "logs") if json_dir else
                                        tempfile.mkdtemp(prefix="rpbench-"))
        os.makedirs(self.log_dir, exist_ok=True)
        self.mode = "maxseq" if args.max_seq_search else "losscurve" if args.loss_steps else "throughput"
        self.tag = f"{time.strftime('%Y%m%d-%H%M%S')}_{args.model}_{args.gpus}g" + (
            "" if self.mode == "throughput" else f"_{self.mode}")
        self.machine = probe_machine(args.device)
        self.results: list = []
        self._md_base = None
        self._json_runs = None

    # where the figures go
    def meta(self) -> dict:
        a, m = self.args, self.machine
        card = (m["names"][0] if m.get("names") else "no GPU") if a.device == "cuda" else "CPU"
        settings = {k: getattr(a, k) for k in ("model", "device", "gpus", "seq_len", "microbatches", "steps", "warmup",
                                                "timeout", "budget", "seed", "lr", "mem_cap_gib", "maxseq_start",
                                                "maxseq_limit", "maxseq_step")}
        settings["systems"] = a.systems
        if self.mode == "losscurve":
            settings.update(steps=a.loss_steps, warmup=0, loss_steps=a.loss_steps, loss_reference=a.loss_reference,
                            loss_rtol=a.loss_rtol)
        else:
            # per system: --warmup, or default_warmup's choice (rpcompile: a step per GPU)
            settings["warmup_by_system"] = {s: default_warmup(s, a.gpus, a.warmup) for s in a.systems}
            settings["warmup"] = a.warmup if a.warmup is not None else max(settings["warmup_by_system"].values(),
                                                                           default=DEFAULT_WARMUP)
        settings["options"] = a.options
        settings["tokens_per_step"] = max(1, a.tokens_per_step // a.seq_len) * a.seq_len
        meta = {"date": self.date, "started_utc": self.started.strftime("%Y-%m-%dT%H:%M:%SZ"), "card": card,
                "gpus": a.gpus, "mode": self.mode, "settings": settings,
                "n_params": self.n_params, "peak_tflops_per_gpu": PEAK_FLOPS_PER_GPU / 1e12, "env": m,
                "command": "python -m benchmarks.harness " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("harness.py") else "",
                "log_dir": self.log_dir, "elapsed_s": round(time.time() - self.t0, 1)}
        if a.device == "cuda" and self.mode == "throughput":
            meta["ceiling_tokens_per_s"] = utilisation(0.0, self.spec, a.seq_len, a.gpus, self.n_params)["ceiling_tokens_per_s"]
        return meta

    def write(self) -> None:
        if self.mode == "losscurve":
            ref, parity = report.loss_parity(self.results, self.args.loss_reference, self.args.loss_rtol)
            for r in self.results:
                r.pop("loss_parity", None)
                if r.get("system") in parity:
                    r["loss_parity"] = parity[r["system"]]
        run = {"meta": self.meta(), "results": self.results}
        if self.args.json:
            if self._json_runs is None:
                try:
                    with open(self.args.json) as f:
                        self._json_runs = json.load(f)
                    if not isinstance(self._json_runs, list):
                        self._json_runs = [self._json_runs]
                except (OSError, ValueError):
                    self._json_runs = []
            os.makedirs(os.path.dirname(os.path.abspath(self.args.json)), exist_ok=True)
            _atomic_write(self.args.json, json.dumps(self._json_runs + [run], indent=1, default=str))
        if self.args.out:
            if self._md_base is None:
                try:
                    with open(self.args.out) as f:
                        self._md_base = f.read()
                except OSError:
                    self._md_base = ""
            _atomic_write(self.args.out, report.append_section(self._md_base, report.render_run(run)))
        if self.args.record:
            run_files.write_run(self.args.record, run)

    # the systems
    def time_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def precheck(self, name: str) -> Optional[dict]:
        """A result for a system that is not run (skipped, or failed before starting), else None."""
        a, sysm, m = self.args, get_system(name), self.machine
        if a.device == "cpu":
            return {"status": "skipped", "reason": "skipped: needs CUDA"} if sysm.needs_cuda else None
        if m.get("count", 0) < a.gpus:
            return {"status": "failed", "reason": f"asked for {a.gpus} GPU(s), {m.get('count', 0)} visible"
                                                  + (f" ({m['probe_error']})" if m.get("probe_error") else "")}
        if a.gpus > 1 and not sysm.multi_gpu and self.mode != "losscurve":
            # (a loss curve does not depend on the GPUs: there the one-GPU baseline runs on the first)
            return {"status": "skipped", "reason": f"skipped: {name} is the one-GPU resident baseline"}
        if sysm.env == "roundpipe" and not os.path.isdir(os.path.join(a.rp_site, "roundpipe")):
            return {"status": "failed", "reason": f"RoundPipe is not installed in {a.rp_site}: run benchmarks/setup_device.sh"}
        # (the bytes per parameter are full fine-tuning's; a LoRA run's frozen weights need no
        # gradient or Adam state: not checked)
        if not a.no_fit_check and not a.options.get("lora"):
            card = min(m["total"][: a.gpus])
            cap = min(card, a.mem_cap_gib * GiB) if a.max_seq_search else card
            need = self.n_params * sysm.gpu_bytes_per_param
            if need > 0.97 * cap:
                return {"status": "skipped", "reason": f"does not fit: weights, gradients and Adam state need "
                                                       f"{need / GiB:.0f} GiB on the GPU, which has {cap / GiB:.0f} GiB"}
            procs = a.gpus if name == "fsdp2" else 1
            host_need = self.n_params * sysm.host_bytes_per_param + procs * BASE_PROCESS_BYTES
            host = m.get("host_mem_bytes") or 0
            if host and host_need > HOST_GUARD * host:
                return {"status": "skipped", "reason": f"does not fit in host RAM: needs about {host_need / GiB:.0f} GiB "
                                                       f"(fp32 master, gradients, Adam state), the host has {host / GiB:.0f} GiB"}
        if self.time_left() < 30:
            return {"status": "skipped", "reason": "skipped: out of the time budget (--budget)"}
        return None

    def child_env(self, name: str) -> dict:
        a, env = self.args, dict(os.environ)
        paths = [REPO]
        if get_system(name).env == "roundpipe":
            paths.insert(0, os.path.abspath(a.rp_site))
            env["PATH"] = os.path.join(os.path.abspath(a.rp_site), "bin") + os.pathsep + env.get("PATH", "")
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("TQDM_DISABLE", "1")          # progress bars would bury the stderr tail
        env["PYTHONUNBUFFERED"] = "1"
        if a.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        else:
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            ids = visible[: a.gpus] if visible else [str(i) for i in range(a.gpus)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        return env

    def make_spec(self, name: str, result_path: str, **extra) -> RunSpec:
        a = self.args
        losscurve = self.mode == "losscurve"
        gpus = 1 if losscurve and a.device == "cuda" and not get_system(name).multi_gpu else a.gpus
        return RunSpec(system=name, model=a.model, device=a.device, gpus=gpus, seq_len=a.seq_len,
                       tokens_per_step=a.tokens_per_step, microbatches=a.microbatches,
                       steps=a.loss_steps if losscurve else a.steps,
                       warmup=0 if losscurve else default_warmup(name, a.gpus, a.warmup), seed=a.seed, lr=a.lr,
                       mode=self.mode, result_path=result_path, mem_cap_gib=a.mem_cap_gib, maxseq_start=a.maxseq_start,
                       maxseq_limit=a.maxseq_limit, maxseq_step=a.maxseq_step, options={**dict(get_system(name).options), **a.options},
                       **extra)

    def launch(self, spec: RunSpec, timeout: float, stem: str) -> dict:
        """Run one child to its end, its timeout, or the host-memory guard."""
        spec_path = os.path.join(self.log_dir, f"{stem}.spec.json")
        with open(spec_path, "w") as f:
            f.write(spec.to_json())
        out_path, err_path = os.path.join(self.log_dir, f"{stem}.out"), os.path.join(self.log_dir, f"{stem}.err")
        host_limit = HOST_GUARD * (self.machine.get("host_mem_bytes") or float("inf"))
        t0 = time.time()
        killed, peak, used0, used_peak = None, 0, host_used(), 0
        # Note [a run's start]: one tree's run of the 2-GPU bar's workload (Llama-3.1-8B) made
        # 20,388 tokens/s alone on a fresh machine and 16,692 as the second side of an A/B on a
        # machine that had run four children before (44th session); the host update's seconds a
        # step went 2.15 -> 3.02. The runs differ in what the host held: page cache, shared files
        # and fragments that earlier runs left. So each run records what the host held as it began
        # (free, cached, shared memory, huge pages), the most anonymous huge pages it came to, and
        # the machine's THP settings (meta's env; on this sandbox a fused AdamW over 2^27 elements
        # stepped in 0.053 s with and without 2 MiB pages, so those are a check, not a suspect);
        # ab.sh drops the page cache and compacts memory before each side where it may. The host's
        # CPU seconds by kind over the setup (from the launch to the timed steps) and over the timed
        # steps (from when the child says so to its end) tell a busy or lent-out host (45th session:
        # the host AdamW's stepping 2.5-2.6 s a step in some runs, 2.0-2.1 s in others, on one kind
        # of machine; 46th: steal, Note [stolen host] in bar.py).
        m0 = meminfo()
        at_launch = {k: m0.get(k) for k in ("MemFree", "Cached", "Shmem", "AnonHugePages")}
        huge_peak = 0
        pss_peak, pss_at = None, float("-inf")
        peak_parts, used_peak_at = None, None
        cpu_at_launch, cpu_at_timed = host_cpu_seconds(), None
        with open(out_path, "ab") as out, open(err_path, "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.child", spec_path], cwd=REPO,
                                    env=self.child_env(spec.system), stdout=out, stderr=err,
                                    start_new_session=True)
            while True:
                rc = proc.poll()
                now = time.time()
                parts = group_resident(proc.pid)
                rss = parts["anon"] + parts["files"] + parts["shmem"]
                if self.args.pss_interval > 0 and now - pss_at >= self.args.pss_interval:
                    pss_peak, pss_at = max(pss_peak or 0, group_pss(proc.pid)), now
                m = meminfo()
                used = host_used(m)
                huge_peak = max(huge_peak, m.get("AnonHugePages", 0) - (at_launch["AnonHugePages"] or 0))
                if rss > peak:     # when each peak came, and what the run's processes held then
                    peak, peak_parts = rss, {**parts, "at_s": round(now - t0, 1)}
                if used - used0 > used_peak:
                    used_peak, used_peak_at = used - used0, round(now - t0, 1)
                if cpu_at_timed is None and read_result(spec.result_path).get("phase") == "timed":
                    cpu_at_timed = host_cpu_seconds()
                if rc is not None:
                    break
                if now - t0 > timeout:
                    killed = f"timeout after {timeout:.0f} s"
                elif used > host_limit:
                    killed = (f"host memory guard: {used / GiB:.0f} GiB of the host's RAM in use "
                              f"(the run's processes: {rss / GiB:.0f} GiB resident)")
                elif spec.mode == "maxseq":
                    raw = read_result(spec.result_path)
                    started = raw.get("current_probe_started")
                    if raw.get("current_probe") and started and now - started > self.args.probe_timeout:
                        killed = f"probe of {raw['current_probe']} tokens ran past {self.args.probe_timeout:.0f} s"
                if killed:
                    kill_group(proc.pid)
                    rc = proc.wait()
                    break
                time.sleep(0.1 if now - t0 < 10 else 0.5)
        cpu_end = host_cpu_seconds()
        kill_group(proc.pid, grace=1.0)           # helpers left behind (compile workers)
        raw = read_result(spec.result_path)
        timed_cpu, setup_cpu = _cpu_between(cpu_at_timed, cpu_end), _cpu_between(cpu_at_launch, cpu_at_timed)
        return {"raw": raw, "rc": rc, "killed": killed, "wall_s": time.time() - t0, "host_rss_peak_bytes": peak,
                "host_used_peak_bytes": used_peak, "host_mem_peak_bytes": max(peak, used_peak),
                "host_pss_peak_bytes": pss_peak, "host_at_launch_bytes": at_launch, "anon_huge_peak_bytes": huge_peak,
                "host_rss_peak_parts": peak_parts, "host_used_peak_at_s": used_peak_at, "host_cpu_timed_s": timed_cpu,
                "host_cpu_setup_s": setup_cpu,
                "stderr_tail": tail(err_path), "logs": [out_path, err_path]}

    def run_system(self, name: str) -> dict:
        pre = self.precheck(name)
        if pre is not None:
            return {"system": name, "label": get_system(name).label, **pre}
        timeout = min(self.args.timeout, self.time_left() - 10)
        if self.args.max_seq_search:
            return self._run_maxseq(name, timeout)
        stem = f"{self.tag}_{name}"
        spec = self.make_spec(name, os.path.join(self.log_dir, f"{stem}.result.json"))
        return self.summarise(name, self.launch(spec, timeout, stem))

    def _status(self, run: dict) -> tuple:
        raw, rc, killed = run["raw"], run["rc"], run["killed"]
        if killed:
            return ("timeout" if "timeout" in killed or "ran past" in killed else "failed"), killed
        if rc == 0 and raw.get("status") == "ok":
            return "ok", ""
        if raw.get("status") == "restart":
            return "restart", raw.get("error", "")
        st = raw.get("status") if raw.get("status") in ("oom", "failed") else "failed"
        if st == "failed" and "out of memory" in (run["stderr_tail"] or "").lower():
            st = "oom"
        reason = raw.get("error") or _last_error_line(run["stderr_tail"]) or f"exit code {rc}"
        return st, reason

    def summarise(self, name: str, run: dict) -> dict:
        a, raw = self.args, run["raw"]
        status, reason = self._status(run)
        info = raw.get("info") or {}
        r = {"system": name, "label": get_system(name).label, "status": status, "reason": reason,
             "exit_code": run["rc"], "wall_s": run["wall_s"],
             # what launch() read of the host (memory, huge pages, CPU seconds)
             **{k: v for k, v in run.items() if k.startswith(("host_", "anon_huge_"))},
             "host_rss_forks_once": True,   # bar.py's _host_bytes
             "child_maxrss_bytes": raw.get("host_maxrss_bytes"),
             "peak_gpu_alloc_bytes": _peak(raw.get("peak_gpu_alloc_bytes"), info, 0),
             "peak_gpu_reserved_bytes": _peak(raw.get("peak_gpu_reserved_bytes"), info, 1), "build_s": raw.get("build_s"),
             "warmup_s": raw.get("warmup_s"), "n_params": raw.get("n_params"), "device_name": raw.get("device_name"),
             "torch": raw.get("torch"), "transformers": raw.get("transformers"), "info": info,
             "notes": list(info.get("notes") or []), "stderr_tail": run["stderr_tail"] if status != "ok" else "",
             "logs": run["logs"]}
        if raw.get("n_params") and raw["n_params"] != self.n_params:
            r["notes"].append(f"model has {raw['n_params']:,} parameters, the formula {self.n_params:,}")
        steps = raw.get("steps") or []
        # every optimizer step's loss, warm-up steps included: losses[0] is step 1
        r["losses"] = [s["loss"] for s in steps]
        r["losses_finite"] = all(_finite(x) for x in r["losses"])
        r["warmup_steps"] = sum(1 for s in steps if not s.get("timed"))
        timed = [s for s in steps if s.get("timed") and "s" in s]
        tokens = raw.get("tokens_per_step") or max(1, a.tokens_per_step // a.seq_len) * a.seq_len
        r["tokens_per_step"] = tokens
        r["step_s"] = [s.get("s") for s in steps]
        r["timed_step_s"] = [s["s"] for s in timed]       # each timed step: the slowest against the median
        r["drain_s"] = raw.get("drain_s")                # in the last timed step: the wait at the end
        r["timed_steps_done"] = len(timed)
        if raw.get("s_per_step") and status == "ok":
            r["s_per_step"] = raw["s_per_step"]
        elif timed:                                   # partial: what was measured before it stopped
            r["s_per_step"] = sum(s["s"] for s in timed) / len(timed)
            r["partial"] = True
            r["notes"].append(f"partial: {len(timed)} of {a.steps} timed steps")
        if self.mode == "losscurve":
            # no warm-up: the step times include compilation, so no throughput is claimed
            r.pop("s_per_step", None)
            r.pop("partial", None)
            r["notes"] = [n for n in r["notes"] if not n.startswith("partial:")]
            if 0 < len(r["losses"]) < a.loss_steps:
                r["notes"].append(f"{len(r['losses'])} of {a.loss_steps} steps")
        if r.get("s_per_step"):
            r["tokens_per_s"] = tokens / r["s_per_step"]
            if a.device == "cuda":
                r.update({k: v for k, v in utilisation(r["tokens_per_s"], self.spec, a.seq_len, a.gpus,
                                                       self.n_params).items() if k in ("mfu", "ceiling_share")})
        if r["losses"] and not r["losses_finite"]:
            r["notes"].append("non-finite loss")
        if info.get("plan_weight_upload_bytes_per_step"):
            r["pcie_bytes_per_step_plan"] = info["plan_weight_upload_bytes_per_step"] + info.get(
                "plan_grad_download_bytes_per_step_est", 0)
            asked, planned = (info.get("config") or {}).get("num_microbatches"), info.get("plan_microbatches")
            split = f" (split from {asked})" if planned and asked and planned != asked else ""
            r["notes"].append(f"plan: {info.get('stage_jobs')} stage jobs, {planned} microbatches{split}, weights up "
                              f"{info['plan_weight_upload_bytes_per_step'] / GiB:.2f} GiB/step, grads down ≈"
                              f"{info.get('plan_grad_download_bytes_per_step_est', 0) / GiB:.2f} GiB/step")
        if info.get("trace"):
            r["trace"] = info["trace"]
            if info["trace"].get("bytes"):
                # host <-> GPU copies; device-to-device ones (Config.peer_transfers: "fetch_peer") apart
                by_name = info["trace"]["bytes"]
                r["pcie_bytes_per_step_trace"] = sum(v for k, v in by_name.items() if "peer" not in k)
                peer = sum(v for k, v in by_name.items() if "peer" in k)
                if peer:
                    r["peer_bytes_per_step_trace"] = peer
            busy = {d: v.get("compute_busy_frac") for d, v in (info["trace"].get("devices") or {}).items()
                    if v.get("compute_busy_frac") is not None}
            steady = info["trace"].get("steady")
            if steady:   # overlapped steps: over one period of the last steps, every step's jobs counted
                busy = steady["compute_busy_frac"]
            if busy:
                r["compute_busy_frac"] = busy
                r["notes"].append(f"compute busy ({'last period' if steady else 'last step'}) "
                                  + ", ".join(f"{d} {100 * f:.0f}%" for d, f in busy.items()))
            idle = {d: v for d, v in ((steady or {}).get("idle_between_steps_s") or {}).items() if v}
            if idle:     # each device's wait between two of the last steps
                r["idle_between_steps_s"] = idle
                r["notes"].append("idle between steps " + ", ".join(
                    f"{d} {1e3 * min(v):.0f}-{1e3 * max(v):.0f} ms" for d, v in idle.items()))
        r["setup_s"] = (raw.get("build_s") or 0) + (raw.get("warmup_s") or 0) or None
        return r

    def _run_maxseq(self, name: str, timeout: float) -> dict:
        """Relaunch the child while probes are left: a dying probe counts as a failed length."""
        t_end = time.time() + timeout
        ok, fail, probes, launches, wall = 0, None, [], 0, 0.0
        status, reason, last, peak_rss, peak_mem = "ok", "", None, 0, 0
        while True:
            stem = f"{self.tag}_{name}_{launches}"
            spec = self.make_spec(name, os.path.join(self.log_dir, f"{stem}.result.json"), maxseq_ok=ok,
                                  maxseq_fail=fail, maxseq_probes=probes)
            run = self.launch(spec, max(1.0, t_end - time.time()), stem)
            launches += 1
            last, raw = run, run["raw"]
            wall += run["wall_s"]
            peak_rss = max(peak_rss, run["host_rss_peak_bytes"])
            peak_mem = max(peak_mem, run["host_mem_peak_bytes"])
            probes = raw.get("probes", probes)
            ok = raw.get("maxseq_ok", ok)
            fail = raw.get("maxseq_fail", fail)
            st, why = self._status(run)
            if st == "ok":
                status, reason = "ok", ""
                break
            current = raw.get("current_probe")
            if st == "restart":                       # the child recorded the failed probe itself
                current = None
            if current and _probe_failed(st, why, run["stderr_tail"]):
                probes.append({"seq_len": current, "ok": False, "error": f"{st}: {_short(why)}"})
                fail = current if fail is None else min(fail, current)
            elif st != "restart":
                status, reason = st, why
                break
            if next_probe(ok, fail, self.args.maxseq_start, self.args.maxseq_limit,
                          self.args.maxseq_step) is None:
                status, reason = "ok", ""
                break
            if t_end - time.time() < 30 or launches >= 10:
                status, reason = "timeout", "search stopped: out of time (bounds so far are shown)"
                break
        r = self.summarise(name, last)
        best = [p for p in probes if p.get("ok") and p["seq_len"] == ok]
        r.update(status=status, reason=reason, probes=probes, maxseq_ok=ok, maxseq_fail=fail, launches=launches,
                 max_seq=ok, wall_s=wall, host_rss_peak_bytes=peak_rss, host_mem_peak_bytes=peak_mem,
                 peak_gpu_at_max_bytes=best[0].get("peak_gpu_alloc_bytes") if best else None,
                 stderr_tail=last["stderr_tail"] if status != "ok" else "")
        for k in ("tokens_per_s", "s_per_step", "mfu", "ceiling_share", "losses", "partial"):
            r.pop(k, None)
        return r

    def run(self) -> list:
        self.write()
        for name in self.args.systems:
            print(f"[harness] {name} ...", flush=True)
            try:
                r = self.run_system(name)
            except Exception as e:  # noqa: BLE001 - the harness itself must not stop
                r = {"system": name, "status": "failed", "reason": f"harness error: {type(e).__name__}: {e}"}
            self.results.append(r)
            print(f"[harness] {name}: {r['status']}"
                  + (f", {r['tokens_per_s']:,.0f} tokens/s" if r.get("tokens_per_s") else "")
                  + (f", max seq {r['max_seq']:,}" if r.get("max_seq") is not None and "max_seq" in r else "")
                  + (f", {bar.stolen_text(r)} (the bar leaves it out: Note [stolen host] in benchmarks/bar.py)"
                     if (bar.stolen(r) or 0) > bar.STEAL_BAR else "")
                  + (f" ({_short(r.get('reason'))})" if r.get("reason") else ""), flush=True)
            self.write()
        return self.results


def _probe_failed(status: str, why: str, stderr_tail: str) -> bool:
    """Whether a max-length child that ended this way answered its current probe "does not fit"
    (the search goes on below it in a new child): out of device memory, a probe past
    --probe-timeout, or the host-memory guard (the length's host buffers do not fit the host's
    RAM: rpcompile at 131,072 tokens on a 126 GiB host). Not the search's own --timeout."""
    if "timeout after" in why:
        return False
    return (status in ("oom", "timeout") or "out of memory" in (stderr_tail or "").lower()
            or why.startswith("host memory guard"))


def _peak(main_bytes, info: dict, k: int):
    """A peak of device memory over the child's process and its worker processes (info's
    peak_gpu_workers: [allocated, reserved] a worker; k picks one), which the child's own figure
    does not see; the child's where there are none."""
    workers = [v[k] for v in (info.get("peak_gpu_workers") or {}).values()]
    return max([main_bytes or 0, *workers]) if workers else main_bytes


def _finite(x) -> bool:
    try:
        return x == x and abs(x) != float("inf")
    except TypeError:
        return False


def _short(text, n=200) -> str:
    return report._short(text, n)


def _last_error_line(text: str) -> str:
    lines = [l for l in (text or "").splitlines() if l.strip()]
    for l in reversed(lines):
        if "Error" in l or "error" in l or "Exception" in l:
            return l.strip()
    return lines[-1].strip() if lines else ""


def _atomic_write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def render_json(json_path: str, out: str, record: str = "") -> None:
    with open(json_path) as f:
        runs = json.load(f)
    runs = runs if isinstance(runs, list) else [runs]
    for run in runs if record else []:
        run_files.write_run(record, run)
    if not out:
        return
    try:
        with open(out) as f:
            text = f.read()
    except OSError:
        text = ""
    for run in runs:
        text = report.append_section(text, report.render_run(run))
    _atomic_write(out, text)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        render_json(args.render, args.out, args.record)
        return 0
    h = Harness(args)
    h.run()
    print(report.render_run({"meta": h.meta(), "results": h.results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
