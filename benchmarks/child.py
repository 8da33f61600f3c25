"""One system in its own process: `python -m benchmarks.child SPEC.json` (the harness starts it).

Writes the result file named in the spec as it goes; exits 0 when the run finished, 3 on a
device out-of-memory, 4 when a max-length search asks to be restarted (RestartRequested), 1 on
any other failure (the traceback goes to stderr).
"""
from __future__ import annotations

import os
import sys
import traceback

from .common import Recorder, RestartRequested, RunSpec, child_failure, is_oom, run_trainer
from .systems import load_runner


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = RunSpec.from_json(f.read())
    rec = Recorder(spec.result_path)
    code = 0
    try:
        runner = load_runner(spec.system)
        if hasattr(runner, "run"):          # systems that manage their own processes (FSDP2)
            runner.run(spec, rec)
        else:
            run_trainer(runner.make_trainer, spec, rec)
        rec.update(status="ok")
    except RestartRequested as e:
        rec.update(status="restart", error=str(e))
        code = 4
    except BaseException as e:  # noqa: BLE001 - everything is reported to the harness
        rec.reload()
        child_failure(rec, e)
        traceback.print_exc()
        code = 3 if is_oom(e) else 1
    print(f"[benchmarks.child] {spec.system}: {rec.data.get('status')}", flush=True)
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Worker threads of the systems (RoundPipe's, rpcompile's) must not keep the process alive.
    os._exit(code)
