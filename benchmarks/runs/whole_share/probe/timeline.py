"""Call 4's probe lined up with its trace, on the host clock (run from this folder):
the worker's "ended"/"landed" sends, the main process's receipt of "landed", the optimizer
thread's chunk waits ("grads") and steps, and cuda:0's compute and gradient downloads."""
import glob, json
rows = [json.loads(line) for f in glob.glob("*.jsonl") for line in open(f)]
t0 = [r for r in rows if r[1] == "t0"][-1][2]
ev = []
for r in rows:
    t = r[0] - t0
    if r[1] in ("grads", "step"):
        ev += [(r[3] - t0, f"opt {r[1]} {r[2]} start"), (t, f"opt {r[1]} {r[2]} end")]
    elif r[1] == "hub_landed":
        ev.append((t, f"MAIN got landed job{r[4]} copy{r[5]}"))
    elif r[1].startswith("worker"):
        ev.append((t, f"W{r[2]} sent {r[1][7:]} job{r[5]}"))
for x in json.load(open("recent.json")):
    if str(x.get("device")) == "cuda:0" and (x["stream"] == "compute" or x["name"] == "download_grads"):
        ev += [(x["start_s"], f"   gpu0 {x['name']} j{x.get('job')} s{x.get('step')} start"),
               (x["end_s"], f"   gpu0 {x['name']} j{x.get('job')} s{x.get('step')} end")]
for t, s in sorted(ev):
    if t > -0.1:
        print(f"{t:7.3f} {s}")
