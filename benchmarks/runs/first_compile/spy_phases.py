"""Sum a py-spy raw profile (record --threads --idle --subprocesses, spy49.sh) of one worker process and its
subprocesses by what the samples do: `python spy_phases.py FILE KIND THREAD`, KIND worker, sidecar or "pool child",
THREAD a thread name or *. The deepest frame that matches a category decides (10 ms a sample at --rate 100)."""
import sys, collections
path, kind_want, thread_want = sys.argv[1], sys.argv[2], sys.argv[3]
# (category, predicate on "func (file:line)") checked from the leaf up: the deepest matching frame decides
cats = [
 ("triton compile (in this process)", lambda f: f.startswith("compile (triton/compiler")),
 ("triton compile (pool child)", lambda f: f.startswith("_worker_compile_triton")),
 ("autotune benchmark", lambda f: f.startswith("CachingAutotuner.benchmark_all_configs")),
 ("wait for pool kernels", lambda f: f.startswith("AsyncCompile.wait") or f.startswith("LambdaFuture.result")),
 ("kernel precompile/load", lambda f: f.startswith("CachingAutotuner.precompile") or f.startswith("StaticAutotunerFuture")),
 ("load module", lambda f: f.startswith("PyCodeCache.load_by_key_path")),
 ("inductor: joint graph passes", lambda f: f.startswith("joint_graph_passes")),
 ("aot: partition", lambda f: f.startswith("min_cut_rematerialization_partition")),
 ("inductor: lowering", lambda f: f.startswith("GraphLowering.run")),
 ("inductor: scheduler", lambda f: f.startswith("Scheduler.__init__")),
 ("inductor: codegen", lambda f: f.startswith("GraphLowering.codegen") or f.startswith("Scheduler.codegen")),
 ("inductor: post grad", lambda f: f.startswith("_recursive_post_grad_passes") or f.startswith("post_grad_passes")),
 ("inductor: fx graph cache", lambda f: "FxGraphCache" in f or "AOTAutogradCache" in f),
 ("inductor: compile_fx other", lambda f: f.startswith("compile_fx_inner") or f.startswith("fx_codegen_and_compile")),
 ("aot: trace joint", lambda f: f.startswith("aot_trace_joint_graph") or f.startswith("create_joint") or f.startswith("aot_dispatch_autograd")),
 ("aot: other", lambda f: f.startswith("create_aot_dispatcher_function")),
 ("dynamo trace", lambda f: f.startswith("_compile.compile_inner") or f.startswith("InstructionTranslator")),
 ("backward (run/other)", lambda f: f.startswith("_engine_run_backward")),
 ("import", lambda f: f.startswith("_find_and_load")),
 ("process group", lambda f: f.startswith("_new_process_group_helper") or f.startswith("init_process_group")),
]
c = collections.Counter(); tot = 0; bw = collections.Counter()
for line in open(path):
    stack, _, n = line.rstrip("\n").rpartition(" "); n = int(n)
    parts = stack.split(";")
    procs = [p for p in parts if p.startswith("process ")]
    leaf = procs[-1]
    kind = "worker" if "rpcompile.runtime.worker" in leaf else ("sidecar" if len(procs) == 2 else "pool child")
    if kind != kind_want: continue
    tname = next((p for p in parts if p.startswith("thread ")), "?").split(": ", 1)[-1]
    if thread_want != "*" and tname != thread_want: continue
    frames = [p for p in parts if not p.startswith(("process ", "thread "))]
    tot += n
    name = None
    for f in reversed(frames):
        for cat, pred in cats:
            if pred(f):
                name = cat; break
        if name: break
    if name is None:
        name = "other: " + frames[-1][:90]
    if any(f.startswith("_engine_run_backward") for f in frames):
        bw[name] += n
    c[name] += n
print("total", tot, "samples (10 ms)")
for k, v in c.most_common(28): print(f"{v:6d}  {k}   (in backward: {bw[k]})")
