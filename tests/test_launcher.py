"""Note [worker launcher]: worker processes are forked from one launcher per environment, which
imported them once; their handles say how each ended, and nothing outlives the main process."""
import os
import signal
import subprocess
import sys
import time

import pytest

from rpcompile.runtime import launcher, worker

TOKEN = bytes(16)


def _stat(pid):
    """(state, parent pid) of a process, or None once it is gone (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return None if fields[0] in "ZX" else (fields[0], int(fields[1]))


def _ends(proc, timeout):
    """proc's exit code; past `timeout`, an AssertionError that says where each of its threads
    waits."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = {}
        for tid in sorted(os.listdir(f"/proc/{proc.pid}/task")):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/wchan") as w, open(f"/proc/{proc.pid}/task/{tid}/comm") as c:
                    where[f"{tid} {c.read().strip()}"] = (w.read().strip(), _stat(int(tid)))
            except OSError:
                pass
        raise AssertionError(f"worker {proc.pid} still runs after {timeout} s; its threads wait in {where}") from None


def _env(tmp_path):
    """(this test's own environment: a launcher of its own, not one other tests' workers came from)"""
    return {**os.environ, "RPCOMPILE_WORKER_DIR": str(tmp_path), "RPCOMPILE_WORKER_TOKEN": TOKEN.hex(),
            "RPCOMPILE_TEST_LAUNCHER": str(tmp_path)}


def test_workers_fork_from_one_launcher_and_say_how_they_ended(tmp_path):
    server = worker.serve_socket(str(tmp_path / "main.sock"))
    env = _env(tmp_path)
    # (pytest names the running test in os.environ: two tests' workers, one launcher)
    procs = [launcher.start_worker({**env, "RPCOMPILE_WORKER_INDEX": str(i), "CUDA_VISIBLE_DEVICES": str(i),
                                    "PYTEST_CURRENT_TEST": f"test_{i} (call)"}) for i in range(2)]
    (key, first), = launcher._launchers.items()       # one launcher for both (each worker's own variables aside)
    assert {_stat(p.pid)[1] for p in procs} == {first.proc.pid}
    conns = [worker.accept(server, TOKEN, timeout=60) for _ in procs]     # they connected, and wait for their part
    # (in the order they connected, which is not always the workers': worker 1's connection taken
    # for worker 0's was left open, and worker 1 waited on it in a loaded suite run)
    by_index = {worker.recv(c)[1]: c for c in conns}
    assert sorted(by_index) == [0, 1]
    assert [p.poll() for p in procs] == [None, None]
    procs[0].kill()
    assert procs[0].wait(timeout=30) == -signal.SIGKILL and procs[0].returncode == -signal.SIGKILL
    by_index[1].close()          # the main process gone before the worker's part came: it fails
    assert _ends(procs[1], 30) == 1
    # (an address Inductor writes into os.environ as it loads a CPU kernel: not another environment)
    failed = launcher.start_worker({**env, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "140074761767968"})
    assert failed.wait(timeout=30) == 1 and launcher._launchers[key] is first     # (no index: it failed as it started)
    # another environment (what an interpreter reads as it starts): another launcher; the last
    # one, asked for no more workers, ends once its children have
    other = launcher.start_worker({**env, "RPCOMPILE_TEST_OTHER_ENVIRONMENT": "1"})
    assert other.wait(timeout=60) == 1 and first.proc.wait(timeout=30) == 0
    assert list(launcher._launchers.values()) != [first]
    server.close()


def test_a_worker_whose_model_went_before_it_started_ends_quietly(tmp_path, capfd):
    """Note [early workers]: a model whose first call failed at once (a PlanningError) removes its
    directory, and a worker the launcher forks after that ends at once, code 0, and says nothing
    (it printed a FileNotFoundError's traceback: seen on an H200, whose launcher imports slower)."""
    gone = tmp_path / "gone"
    proc = launcher.start_worker({**_env(gone), "RPCOMPILE_WORKER_INDEX": "0"})
    assert proc.wait(timeout=60) == 0
    assert "Error" not in capfd.readouterr().err


def test_the_launcher_and_its_workers_end_with_the_main_process(tmp_path):
    """A main process that exits (here without a word to its workers) leaves neither its
    workers nor their launcher behind."""
    script = tmp_path / "main.py"
    script.write_text(
        "import os, sys\n"
        "from rpcompile.runtime import launcher, worker\n"
        f"server = worker.serve_socket({str(tmp_path / 'main.sock')!r})\n"
        f"p = launcher.start_worker({{**os.environ, 'RPCOMPILE_WORKER_DIR': {str(tmp_path)!r}, "
        f"'RPCOMPILE_WORKER_TOKEN': {TOKEN.hex()!r}, 'RPCOMPILE_WORKER_INDEX': '0'}})\n"
        f"conn = worker.accept(server, {TOKEN!r}, timeout=60)\n"
        "(l,) = launcher._launchers.values()\n"
        "print(p.pid, l.proc.pid, flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    pids = [int(x) for x in res.stdout.split()]
    deadline = time.monotonic() + 30
    while any(map(_stat, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_stat, pids)), [_stat(p) for p in pids]


@pytest.mark.parametrize("end", ["os._exit(0)", "sys.exit(0)", "cm.synchronize(); os._exit(0)"])
def test_workers_in_a_step_end_with_the_main_process(tmp_path, end):
    """A main process that ends while a delayed-mode step's jobs still run (the optimizer is
    slowed: a backward job waits for the gradient piece it holds).
    - os._exit (SIGKILL, a SIGTERM to it alone): it says nothing to its workers. The worker
      waiting for the piece never read the main connection's end; it and the launcher lived on
      for ever, holding the caller's stdout (`python train.py | tail` never returned). Now the
      launcher sees its parent gone, kills its children and removes the run's shared files
      (Note [workers of a main process that died]). After synchronize its workers are idle and
      end on their own; the launcher removes the files then too (they stayed until the next run).
    - an exit without cm.synchronize(): the finalizers waited 10 s for that worker and 10 s for
      the optimizer thread (Note [stopped with a step in flight]); the bound here is well under
      those 20 s, and well over the 1 s the workers get now."""
    script = tmp_path / "main.py"
    script.write_text(
        "import os, sys\n"
        "sys.path.insert(0, os.path.join(os.environ['RPCOMPILE_ROOT'], 'tests'))\n"
        "import torch, rpcompile\n"
        "import torch.nn.functional as F\n"
        "from models import MLP\n"
        "from rpcompile.runtime import launcher\n"
        "model = MLP()\n"      # (no transformers: a Qwen3's import and capture took 7 s of its 15)
        "cm = rpcompile.compile(model, rpcompile.Config(devices=['cpu', 'cpu'], num_microbatches=2, loss_fn=F.mse_loss,\n"
        "                                               optimizer_mode='delayed', workers='processes'))\n"
        "class Slow(torch.optim.SGD):\n"
        "    def step(self, closure=None):\n"
        "        import time; time.sleep(0.3)\n"
        "        return super().step(closure)\n"
        "cm.attach_optimizer(Slow(model.parameters(), lr=0.1), chunks=2)\n"
        "for t in range(3):\n"
        "    cm.train_step(torch.randn(6, 8), target=torch.randn(6, 4))\n"
        "(l,) = launcher._launchers.values()\n"
        "print(l.proc.pid, *[p.pid for p in cm.runner.executor.hub.procs], flush=True)\n"
        "print(cm.runner.executor.memory.directory, flush=True)\n"
        "print(bool(cm.runner.executor.hub.runs), flush=True)\n"     # a step in flight as it ends
        f"{end}\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "RPCOMPILE_ROOT": root,
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        directory = proc.stdout.readline().strip()
        in_flight = proc.stdout.readline().strip()
        ended = time.monotonic()
        out, err = proc.communicate(timeout=120)      # (stdout closes once nothing holds it)
        took = time.monotonic() - ended
    finally:
        proc.kill()
    assert proc.returncode == 0 and pids and directory, err[-2000:]
    assert in_flight == "True", "the step had ended before the main process did: the optimizer is not slow enough"
    deadline = time.monotonic() + 30
    while (any(map(_stat, pids)) or os.path.exists(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_stat, pids)), [_stat(p) for p in pids]
    assert not os.path.exists(directory)
    assert took < 12, f"{end} took {took:.1f} s"
