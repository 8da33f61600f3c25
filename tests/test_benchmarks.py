"""The benchmark harness: FLOP formula, table writer, max-length search, loss parity, rpcompile's
options and trace summary, and the harness end to end on CPU (rpcompile and eager on the tiny
model; GPU-only systems reported as skipped; a failing, a slow and a crashing pretend system
recorded without stopping the harness)."""
import dataclasses
import json
import math
import os
import re
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # `pytest` as well as `python -m pytest`
from benchmarks import bar, common, harness, report, run_files  # noqa: E402
from benchmarks.systems import SYSTEMS, get_system  # noqa: E402
from benchmarks.systems import rpcompile_runner  # noqa: E402


# --- FLOPs and parameter counts ----------------------------------------------------------------
def test_param_count_by_hand():
    # Qwen3-1.7B: tied 151936 x 2048 embedding; per layer q 2048x2048, k and v 2048x1024, o 2048x2048,
    # gate/up/down 3 x 2048x6144, two RMSNorms of 2048 and q_norm/k_norm of 128; a final norm.
    layer = 2048 * 2048 + 2 * 2048 * 1024 + 2048 * 2048 + 3 * 2048 * 6144 + 2 * 2048 + 2 * 128
    assert common.param_count(common.get_model("qwen3-1.7b")) == 151936 * 2048 + 28 * layer + 2048 == 1_720_574_976
    # Llama-3.1-8B: untied, so embedding and LM head both count; no q/k norms.
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert common.param_count(common.get_model("llama3.1-8b")) == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248


def test_moe_param_counts_by_hand():
    # Qwen3-30B-A3B's layers: q 2048x4096, k and v 2048x512, o 4096x2048; a router 2048x128 and 128
    # experts of gate/up/down 3 x 2048x768, 8 of them a token; q_norm/k_norm; untied head.
    attention, norms = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 2048 + 2 * 128, 2 * 151936 * 2048 + 2048
    spec = common.get_model("qwen3-30b-a3b-6l")
    assert common.param_count(spec) == norms + 6 * (attention + 128 * 2048 + 128 * 3 * 2048 * 768) == 4_361_055_744
    assert common.param_count(spec, active=True) == norms + 6 * (attention + 128 * 2048 + 8 * 3 * 2048 * 768)
    u = common.utilisation(1000.0, spec, 2048, gpus=1, n_params=common.param_count(spec) + 5)   # + 5 LoRA weights
    assert u["model_flops_per_token"] == common.flops_per_token(common.param_count(spec, active=True) + 5, 6, 32,
                                                                128, 2048)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "tiny-moe"])
def test_param_count_matches_the_built_model(name):
    spec = common.get_model(name)
    model = common.build_model(spec)
    assert common.count_params(model) == common.param_count(spec)
    assert model.config._attn_implementation == "sdpa"


def test_flops_formula_against_a_hand_count():
    n, L, H, Q, S = 1_720_574_976, 28, 16, 128, 2048
    # 6N + 12·L·H·Q·S and, with the forward recomputed, 8N + 16·L·H·Q·S
    assert common.flops_per_token(n, L, H, Q, S) == 6 * n + 12 * 28 * 16 * 128 * 2048 == 11_732_736_000
    assert common.flops_per_token(n, L, H, Q, S, recompute=True) == 15_643_648_000
    u = common.utilisation(50_000.0, common.get_model("qwen3-1.7b"), 2048, gpus=2)
    assert u["mfu"] == pytest.approx(50_000 * 11_732_736_000 / (2 * 790e12))
    assert u["ceiling_tokens_per_s"] == pytest.approx(2 * 790e12 / 15_643_648_000)
    assert u["ceiling_share"] == pytest.approx(50_000 / u["ceiling_tokens_per_s"])


def test_microbatch_weights_sum_to_one():
    ids = common.batch_ids(512, 10, 8, step=0)
    parts = common.microbatches(ids, 4)
    assert [c.shape[0] for c, _ in parts] == [3, 3, 2, 2]
    assert sum(w for _, w in parts) == pytest.approx(1.0)
    assert common.batch_ids(512, 10, 8, step=3).equal(common.batch_ids(512, 10, 8, step=3))


def test_max_seq_search_doubles_then_bisects():
    seq, ok, fail, fits = [], 0, None, 40_000         # pretend 40,000 tokens is the most that fits
    while (s := common.next_probe(ok, fail, start=4096, limit=262144)) is not None:
        seq.append(s)
        ok, fail = (s, fail) if s <= fits else (ok, s)
    assert seq[:5] == [4096, 8192, 16384, 32768, 65536]
    assert all(x % 1024 == 0 for x in seq)
    assert fail - ok <= 1024 and ok == 39936
    assert common.next_probe(0, 1024, 4096, 262144) is None            # not even 1,024 tokens
    assert common.next_probe(262144, None, 4096, 262144) is None       # reached the limit


# --- the table ---------------------------------------------------------------------------------
def _run_record():
    meta = {"date": "2026-11-26 12:00 UTC", "card": "NVIDIA H100 80GB HBM3", "gpus": 1, "mode": "throughput",
            "settings": {"model": "qwen3-1.7b", "seq_len": 2048, "tokens_per_step": 65536, "microbatches": 4,
                         "steps": 5, "warmup": 2},
            "n_params": 1_720_574_976, "ceiling_tokens_per_s": 50_500.0, "env": {"torch": "2.11.0", "cpu_count": 16,
                                                                               "host_mem_bytes": 128 * 2**30}}
    results = [
        {"system": "rpcompile", "status": "ok", "tokens_per_s": 30_000.0, "s_per_step": 2.18, "mfu": 0.55,
         "ceiling_share": 0.59, "peak_gpu_alloc_bytes": 20 * 2**30, "host_mem_peak_bytes": 40 * 2**30,
         "losses": [12.1, 12.0], "losses_finite": True, "setup_s": 61.0, "notes": ["plan: 9 stage jobs"]},
        {"system": "eager", "status": "ok", "tokens_per_s": 24_000.0, "s_per_step": 2.73, "losses": [12.1, float("nan")],
         "losses_finite": False},
        {"system": "roundpipe", "status": "failed", "reason": "RuntimeError: no | pipes", "stderr_tail": "Traceback\nRuntimeError: boom"},
        {"system": "fsdp2", "status": "skipped", "reason": "skipped: needs CUDA"},
    ]
    return {"meta": meta, "results": results}


def test_table_writer():
    text = report.render_run(_run_record())
    lines = text.splitlines()
    assert lines[0] == "## 2026-11-26 12:00 UTC · NVIDIA H100 80GB HBM3 × 1 · qwen3-1.7b · throughput"
    assert "65,536 tokens/step" in text and "4 microbatches" in text and "50,500 tokens/s" in text
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", l)[1:-1]] for l in lines if l.startswith("| ")]
    rows = {c[0]: c for c in cells}
    header = rows["system"]
    assert header[:4] == ["system", "status", "tokens/s", "s/step"]
    assert len({len(r) for r in rows.values()}) == 1                       # every row has every column
    col = {name: header.index(name) for name in header}
    assert rows["rpcompile"][col["tokens/s"]] == "30,000" and rows["rpcompile"][col["MFU"]] == "55.0%"
    assert rows["rpcompile"][col["peak GPU mem"]] == "20.0 GiB" and rows["rpcompile"][col["host mem peak"]] == "40.0 GiB"
    assert rows["eager"][col["rpcompile ÷ system"]] == "1.25×"
    assert "non-finite" in rows["eager"][col["loss (first → last)"]]
    assert rows["roundpipe"][col["status"]] == "failed" and "no \\| pipes" in text
    assert rows["fsdp2"][col["notes"]] == "skipped: needs CUDA"
    assert "RuntimeError: boom" in text.split("<details>")[1]             # the stderr tail of the failure

    fresh = report.append_section("", text)
    assert fresh.startswith("# Benchmark results") and fresh.endswith(text.rstrip("\n") + "\n")
    again = report.append_section(fresh, text)
    assert again.startswith(fresh.rstrip("\n")) and again.count("## 2026-11-26") == 2


def test_render_json_appends_every_run(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps([_run_record(), _run_record()]))
    out = tmp_path / "RESULTS.md"
    out.write_text("# mine\n")
    harness.main(["--render", str(tmp_path / "r.json"), "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# mine\n") and text.count("| rpcompile | ok |") == 2


# --- the harness end to end on CPU -------------------------------------------------------------
def _harness(tmp_path, *args, model="tiny"):
    out, js = tmp_path / "RESULTS.md", tmp_path / "results.json"
    harness.main(["--model", model, "--device", "cpu", "--out", str(out), "--json", str(js), *args])
    runs = json.loads(js.read_text())
    return {r["system"]: r for r in runs[-1]["results"]}, out.read_text(), runs[-1]["meta"]


def test_harness_runs_rpcompile_and_eager_on_cpu(tmp_path):
    res, md, meta = _harness(tmp_path, "--gpus", "2", "--seq-len", "32", "--tokens-per-step", "256",
                             "--microbatches", "2", "--steps", "2", "--warmup", "1", "--timeout", "120",
                             "--systems", "rpcompile,eager,roundpipe,fsdp2,rpcompile-call")
    for name in ("rpcompile", "eager", "rpcompile-call"):
        r = res[name]
        assert r["status"] == "ok", r.get("stderr_tail") or r.get("reason")
        assert r["tokens_per_step"] == 256 and r["tokens_per_s"] > 0
        assert len(r["losses"]) == 3 and r["losses_finite"]
        assert r["n_params"] == common.param_count(common.get_model("tiny"))
        assert r["host_rss_peak_bytes"] > 0 and r["host_mem_peak_bytes"] >= r["host_rss_peak_bytes"]
        assert r["timed_steps_done"] == 2
        assert len(r["timed_step_s"]) == 2 and all(x > 0 for x in r["timed_step_s"])   # for slowest / median
    assert res["rpcompile"]["info"]["stage_jobs"] >= 1 and "rpcompile plan" in res["rpcompile"]["info"]["plan"]
    # the count the plan runs, which Config.split_microbatches may make finer than --microbatches
    assert res["rpcompile"]["info"]["plan_microbatches"] == 2 and " stage jobs, 2 microbatches, weights up" in md
    # the runtime's host buffers by kind: [buffers, bytes] (rpcompile.runtime.host_buffers)
    assert res["rpcompile"]["info"]["host_buffers"]["gradients"][1] > 0
    # where the first steps go: the capture and every pass of each plan, and first calls per device
    from rpcompile.passes import PASSES
    first_plan = res["rpcompile"]["info"]["compile_seconds"][0]
    assert list(first_plan) == ["dynamo_capture"] + [name for name, _, _ in PASSES] and min(first_plan.values()) >= 0
    assert isinstance(res["rpcompile"]["info"]["first_calls"], dict)
    # each job's measured compute beside its estimate (the cost model's error, job by job)
    est, measured = res["rpcompile"]["info"]["plan_job_est_s"], res["rpcompile"]["trace"]["job_compute_s"]
    assert len(est) == res["rpcompile"]["info"]["stage_jobs"] and sorted(map(int, measured)) == list(range(len(est)))
    assert all(v > 0 for v in measured.values())
    assert res["rpcompile"]["trace"]["count"]["compute/forward"] >= 1      # cm.last_trace, summed per stream
    devices = res["rpcompile"]["trace"]["devices"]                         # ... and per device (two CPU workers)
    assert set(devices) == {"0:cpu", "1:cpu"}
    for d in devices.values():
        assert 0 < d["compute_busy_frac"] <= 1 and d["weights_in_exposed_s"] >= 0
    assert sum(d["bytes"].get("acts_in", 0) for d in devices.values()) > 0
    # busy over the last period (from the second-to-last step's first compute to the last's),
    # every step's compute counted: runner.recent_traces()
    steady = res["rpcompile"]["trace"]["steady"]
    assert steady["period_s"] > 0 and set(steady["compute_busy_frac"]) == {"0:cpu", "1:cpu"}
    assert all(0 < f <= 1 for f in steady["compute_busy_frac"].values())
    assert res["rpcompile"]["compute_busy_frac"] == steady["compute_busy_frac"]
    assert "compute busy (last period) 0:cpu" in md
    # and each device's wait between two of the last steps
    assert set(res["rpcompile"]["idle_between_steps_s"]) <= {"0:cpu", "1:cpu"} and "idle between steps" in md
    assert res["rpcompile"]["warmup_steps"] == 1 and meta["settings"]["warmup_by_system"]["rpcompile"] == 1
    # same weights, same batches: the first loss agrees (bf16 compute both ways)
    assert res["rpcompile"]["losses"][0] == pytest.approx(res["eager"]["losses"][0], abs=0.05)
    # the PyTorch loop's way, cm(...).loss.backward(); opt.step(), in exact mode: train_step's losses
    assert res["rpcompile-call"]["losses"] == pytest.approx(res["rpcompile"]["losses"], rel=1e-4)
    for name in ("roundpipe", "fsdp2"):
        assert res[name]["status"] == "skipped" and res[name]["reason"] == "skipped: needs CUDA"
    assert meta["card"] == "CPU" and meta["settings"]["microbatches"] == 2
    assert md.startswith("# Benchmark results") and "| rpcompile | ok |" in md and "| eager | ok |" in md


def test_harness_trains_a_mixture_of_experts_on_cpu(tmp_path):
    """The MoE shape (transformers' Qwen3-MoE, no router loss) in rpcompile and eager: the same losses."""
    res, _, _ = _harness(tmp_path, "--gpus", "2", "--seq-len", "16", "--tokens-per-step", "128", "--microbatches", "2",
                         "--steps", "2", "--warmup", "1", "--timeout", "120", "--systems", "rpcompile-delayed,eager",
                         model="tiny-moe")
    for r in res.values():
        assert r["status"] == "ok", r.get("stderr_tail") or r.get("reason")
        assert r["n_params"] == common.param_count(common.get_model("tiny-moe"))
    assert res["rpcompile-delayed"]["losses"][0] == pytest.approx(res["eager"]["losses"][0], rel=1e-4)   # same weights


def test_harness_runs_lora_on_every_system(tmp_path):
    """--option lora=R gives every system the model with LoRA adapters of rank R on its linear
    layers (benchmarks.common.add_lora): only they train, and rpcompile's losses are eager's."""
    spec = common.get_model("tiny")
    model = common.build_model(spec, lora=4)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any("lm_head" in n for n in trainable) and type(model).__name__ == "Qwen3ForCausalLM"
    q, kv, h, i = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.hidden, spec.intermediate
    per_layer = 4 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))    # r (in + out) per linear
    assert sum(trainable.values()) == spec.layers * per_layer
    res, md, meta = _harness(tmp_path, "--gpus", "2", "--seq-len", "32", "--tokens-per-step", "256",
                             "--microbatches", "2", "--steps", "2", "--warmup", "1", "--timeout", "120",
                             "--systems", "rpcompile-delayed,eager", "--option", "lora=4")
    for name in ("rpcompile-delayed", "eager"):
        r = res[name]
        assert r["status"] == "ok", r.get("stderr_tail") or r.get("reason")
        assert r["n_params"] == common.param_count(spec) + spec.layers * per_layer
        assert len(r["losses"]) == 3 and r["losses_finite"]
    # the adapters' gradients alone come down (bf16 or fp32), not every weight's
    down = res["rpcompile-delayed"]["info"]["plan_grad_download_bytes_per_step_est"]
    assert down in (2 * sum(trainable.values()), 4 * sum(trainable.values())), down
    # the same starting weights (adapters' B = 0: the base model's loss), bf16 compute both ways;
    # tests/test_zoo.py checks LoRA training against eager peft's step by step, in fp32
    assert res["rpcompile-delayed"]["losses"][0] == pytest.approx(res["eager"]["losses"][0], abs=1e-3)
    assert meta["settings"]["options"] == {"lora": "4"}


def test_harness_traces_the_optimizers_work_on_the_devices_beside_the_steps(tmp_path):
    """With a trace directory the last steps' file holds the update's spans on the devices
    (Note [optimizer spans], runtime/optimizer.py) under each device's worker."""
    trace = tmp_path / "trace"
    res, _, _ = _harness(tmp_path, "--gpus", "2", "--seq-len", "32", "--tokens-per-step", "256",
                         "--microbatches", "2", "--steps", "2", "--warmup", "1", "--timeout", "120",
                         "--systems", "rpcompile-delayed", "--option", "rpcompile_optimizer_on_devices=1.0",
                         "--option", f"rpcompile_trace_dir={trace}")
    r = res["rpcompile-delayed"]
    assert r["status"] == "ok", r.get("stderr_tail") or r.get("reason")
    recent = json.loads((trace / "rpcompile-delayed_2g.recent.json").read_text())
    ours = [sp for sp in recent if sp["stream"] in ("optimizer", "optimizer_down")]
    # (delayed mode keeps the stepped masters there: Note [masters kept on the devices], runtime/flat.py)
    assert {sp["name"] for sp in ours} == {"step_on_device", "copies_down"}
    assert {sp["worker"] for sp in ours} <= {sp["worker"] for sp in recent if sp["stream"] == "compute"}
    chrome = json.loads((trace / "rpcompile-delayed_2g.recent.chrome.json").read_text())
    assert {"optimizer", "optimizer_down"} <= {e["args"]["name"] for e in chrome["traceEvents"]
                                               if e["name"] == "thread_name"}
    assert r["compute_busy_frac"] and all(0 < f <= 1 for f in r["compute_busy_frac"].values())
    assert "optimizer_trace_error" not in r["info"]


def test_harness_records_failures_and_timeouts_and_goes_on(tmp_path):
    res, md, _ = _harness(tmp_path, "--systems", "simulated", "--option", "fail=step", "--timeout", "60")
    r = res["simulated"]
    assert r["status"] == "failed" and "simulated failure in a step" in r["reason"]
    assert "simulated failure in a step" in r["stderr_tail"] and "<details>" in md

    # the child runs 60 s of steps; 10 s leave room for its imports on a loaded 2-core machine
    res, _, _ = _harness(tmp_path, "--systems", "simulated", "--option", "sleep=0.3", "--steps", "200",
                         "--warmup", "1", "--timeout", "10")
    r = res["simulated"]
    assert r["status"] == "timeout" and r.get("partial") and r["tokens_per_s"] > 0   # what it measured is kept


def test_harness_says_when_steal_took_the_hosts_cpu(tmp_path, monkeypatch, capsys):
    """Note [stolen host] (bar.py): the harness's line for a result names the steal that took more
    than the bar's share of the host's CPU over the timed steps."""
    real, reads = harness.host_cpu_seconds, []

    def stolen_more():      # 10 CPU-s of steal more at every read: far above 2% of a short run's
        reads.append(1)
        return {**real(), "steal": 10.0 * len(reads)}
    monkeypatch.setattr(harness, "host_cpu_seconds", stolen_more)
    # (steps of 0.3 s: the harness reads the host's CPU when it sees the timed steps begin, polling
    # every 0.1 s; 0.05 s steps could all end between two looks on a loaded machine)
    res, _, _ = _harness(tmp_path, "--systems", "simulated", "--option", "sleep=0.3", "--steps", "2",
                         "--warmup", "1", "--timeout", "60")
    r = res["simulated"]
    assert r["status"] == "ok" and r["host_cpu_timed_s"]["steal"] >= 10 and r["host_cpu_setup_s"]["steal"] >= 10
    assert "steal took" in capsys.readouterr().out and bar.stolen(r) > bar.STEAL_BAR


def test_harness_records_each_run_as_a_file(tmp_path):
    runs_dir = tmp_path / "runs"
    res, _, meta = _harness(tmp_path, "--systems", "simulated", "--option", "sleep=0.05", "--steps", "3",
                            "--warmup", "1", "--timeout", "60", "--record", str(runs_dir))
    r = res["simulated"]
    assert r["status"] == "ok" and len(r["timed_step_s"]) == 3 and all(x >= 0.05 for x in r["timed_step_s"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["started_utc"])
    files = os.listdir(runs_dir)
    stamp = meta["started_utc"].replace("-", "").replace(":", "")
    assert files == [f"{stamp}_CPU_x1_tiny.json"]                 # time, card, GPU count, model
    recorded = json.loads((runs_dir / files[0]).read_text())
    assert recorded["meta"]["started_utc"] == meta["started_utc"]
    assert recorded["results"][0]["timed_step_s"] == r["timed_step_s"]
    # the harness's --json list of runs, recorded back on the development machine
    again = tmp_path / "again"
    harness.main(["--render", str(tmp_path / "results.json"), "--out", "", "--record", str(again)])
    assert os.listdir(again) == files
    loaded = run_files.load_runs(str(again))
    assert len(loaded) == 1 and loaded[0]["results"] == recorded["results"]
    assert loaded[0]["meta"]["source"].endswith(files[0])


def test_run_file_names():
    meta = {"date": "2026-11-26 10:17 UTC", "card": "NVIDIA H100 80GB HBM3", "gpus": 4, "mode": "throughput",
            "settings": {"model": "llama3.1-8b"}}
    assert run_files.run_file_name(meta) == "20261126T1017Z_NVIDIA-H100-80GB-HBM3_x4_llama3.1-8b.json"
    meta.update(started_utc="2026-11-26T10:17:03Z", mode="losscurve")
    assert run_files.run_file_name(meta) == "20261126T101703Z_NVIDIA-H100-80GB-HBM3_x4_llama3.1-8b_losscurve.json"
    meta["settings"]["options"] = {"lora": "32"}
    assert run_files.run_file_name(meta) == "20261126T101703Z_NVIDIA-H100-80GB-HBM3_x4_llama3.1-8b_lora32_losscurve.json"


@pytest.mark.parametrize("how", ["exit_on_oom", "restart_after_oom"])
def test_max_seq_search_restarts_a_child_that_dies(tmp_path, how):
    # past 3,000 tokens the pretend system ends its process, as RoundPipe's threads do on an OOM,
    # or asks for a fresh process, as the RoundPipe runner does after an OOM in the main thread
    res, md, meta = _harness(tmp_path, "--systems", "simulated", "--max-seq-search", "--maxseq-start", "1024",
                             "--option", "oom_above=3000", "--option", f"{how}=1", "--timeout", "60")
    r = res["simulated"]
    assert r["status"] == "ok" and r["max_seq"] == 2048 and r["maxseq_fail"] == 3072 and r["launches"] == 2
    assert [(p["seq_len"], p["ok"]) for p in r["probes"]] == [(1024, True), (2048, True), (4096, False), (3072, False)]
    assert meta["mode"] == "maxseq" and "max sequence length" in md


def test_max_seq_search_times_a_new_length_beside_a_known_one(tmp_path):
    # every length that trains runs twice: the second step is the known-length figure
    res, md, meta = _harness(tmp_path, "--systems", "simulated", "--max-seq-search", "--maxseq-start", "1024",
                             "--option", "oom_above=2500", "--option", "new_length_s=0.3", "--timeout", "60",
                             "--option", "profile_probes=5")
    ok = [p for p in res["simulated"]["probes"] if p["ok"]]
    assert [p["seq_len"] for p in ok] == [1024, 2048]
    assert all(p["s"] - p["repeat_s"] > 0.25 and p["repeat_s"] < 0.25 for p in ok)
    # --option profile_probes=N: the new length's step profiled, its N costliest functions kept
    for p in ok:
        assert len(p["profile"]) == 5
        sleep = next(r for r in p["profile"] if "sleep" in r[0])
        assert sleep[1] >= 0.25
    assert all(p["repeat_s"] is None for p in res["simulated"]["probes"] if not p["ok"])
    assert "new length: s over a known one" in md and "first 0.3; then 0.3 (0.3), probes profiled (inflated)" in md


def test_a_probe_stopped_by_the_host_memory_guard_is_a_length_that_does_not_fit():
    # the search goes on below it in a new child, as after an OOM, instead of ending the system's search
    from benchmarks.harness import _probe_failed
    guard = "host memory guard: 118 GiB of the host's RAM in use (the run's processes: 114 GiB resident)"
    assert _probe_failed("failed", guard, "")
    assert _probe_failed("oom", "out of memory", "")
    assert _probe_failed("timeout", "probe of 65536 tokens ran past 300 s", "")
    assert not _probe_failed("timeout", "timeout after 500 s", "")
    assert not _probe_failed("failed", "RuntimeError: a bug", "Traceback ...")


# --- the same data, optimizer and warm-up for every system --------------------------------------
def test_every_process_trains_its_slice_of_one_global_batch():
    # FSDP2's ranks used to draw their own batches; now they split the batch every system trains
    spec = common.RunSpec(system="fsdp2", model="tiny", seq_len=8, tokens_per_step=64, lr=3e-4)
    whole = common.step_batch(spec, step=3)
    assert whole.shape == (8, 8) and whole.equal(common.batch_ids(512, 8, 8, step=3))
    assert torch_cat([common.step_batch(spec, 3, rank, 2) for rank in range(2)]).equal(whole)
    assert not common.step_batch(spec, 4).equal(whole)
    assert common.adamw_kwargs(spec) == {"lr": 3e-4, "weight_decay": common.WEIGHT_DECAY}


def torch_cat(parts):
    import torch
    return torch.cat(parts)


def test_default_warmup_gives_rpcompile_a_step_per_gpu():
    # stage job k of step s runs on GPU (s*J + k) mod N: N steps see every (stage, GPU) pair
    for name in ("rpcompile", "rpcompile-overlapped", "rpcompile-delayed", "rpcompile-p2p",
                 "rpcompile-overlapped-p2p"):
        assert get_system(name).rotates_over_gpus
        assert [harness.default_warmup(name, n) for n in (1, 2, 3, 4, 8, 16)] == [2, 2, 3, 4, 8, 8]
        assert harness.default_warmup(name, 4, given=1) == 1                   # --warmup wins
    assert harness.default_warmup("eager", 4) == harness.default_warmup("roundpipe", 8) == 2
    assert harness.parse_args(["--model", "tiny", "--gpus", "4", "--tokens-per-step", "8192"]).warmup is None


# --- rpcompile's options ------------------------------------------------------------------------
@dataclasses.dataclass
class _ConfigWithPeers:
    optimizer_mode: str = "exact"
    peer_transfers: bool = False


@dataclasses.dataclass
class _ConfigWithoutPeers:
    optimizer_mode: str = "exact"


def test_rpcompile_options_become_config_fields():
    def spec(name, **extra):
        return common.RunSpec(system=name, model="tiny", options={**dict(get_system(name).options), **extra})

    assert rpcompile_runner.config_options(spec("rpcompile"), _ConfigWithPeers) == ({}, [])
    kw, notes = rpcompile_runner.config_options(spec("rpcompile-p2p"), _ConfigWithPeers)
    assert kw == {"peer_transfers": True} and "peer_transfers=True" in notes[0]
    kw, notes = rpcompile_runner.config_options(spec("rpcompile-overlapped-p2p"), _ConfigWithPeers)
    assert kw == {"optimizer_mode": "overlapped", "peer_transfers": True} and len(notes) == 2
    kw, notes = rpcompile_runner.config_options(spec("rpcompile-delayed"), _ConfigWithPeers)
    assert kw == {"optimizer_mode": "delayed"} and "one step late" in notes[0]
    kw, _ = rpcompile_runner.config_options(spec("rpcompile", rpcompile_peer="1"), _ConfigWithPeers)
    assert kw == {"peer_transfers": True}                                    # --option rpcompile_peer=1
    # without the field only the option that needs it fails, and says why
    assert rpcompile_runner.config_options(spec("rpcompile-overlapped"), _ConfigWithoutPeers)[0] == {
        "optimizer_mode": "overlapped"}
    with pytest.raises(RuntimeError, match="no peer_transfers field"):
        rpcompile_runner.config_options(spec("rpcompile-p2p"), _ConfigWithoutPeers)
    assert SYSTEMS["rpcompile-p2p"].module == SYSTEMS["rpcompile"].module
    # and against the real Config
    import rpcompile
    kw, _ = rpcompile_runner.config_options(spec("rpcompile-p2p"), rpcompile.Config)
    assert rpcompile.Config(devices=["cpu", "cpu"], **kw).peer_transfers is True
    kw, _ = rpcompile_runner.config_options(spec("rpcompile-delayed"), rpcompile.Config)
    assert rpcompile.Config(devices=["cpu", "cpu"], **kw).optimizer_mode == "delayed"
    kw, notes = rpcompile_runner.config_options(spec("rpcompile-delayed-dp"), rpcompile.Config)
    assert kw == {"optimizer_mode": "delayed", "workers": "threads", "data_parallel": True} and "replica" in notes[2]
    assert rpcompile.Config(devices=["cpu", "cpu"], **kw).workers == "threads"   # (replicas on worker threads)
    with pytest.raises(RuntimeError, match="no data_parallel field"):
        rpcompile_runner.config_options(spec("rpcompile-delayed-dp"), _ConfigWithoutPeers)
    kw, notes = rpcompile_runner.config_options(spec("rpcompile", rpcompile_memory_budget_gib="80"), rpcompile.Config)
    assert kw == {"memory_budget": 80 * 2**30} and "80 GiB" in notes[0]   # a plan for less than the card
    kw, notes = rpcompile_runner.config_options(spec("rpcompile", rpcompile_host_budget_gib="107"), rpcompile.Config)
    assert rpcompile.Config(**kw).host_memory_budget == 107 * 2**30 and "107 GiB" in notes[0]
    for value, split in (("0", False), ("1", True)):
        kw, notes = rpcompile_runner.config_options(spec("rpcompile", rpcompile_split_microbatches=value), rpcompile.Config)
        assert kw == {"split_microbatches": split} and rpcompile.Config(**kw).split_microbatches is split


def test_trace_summary_per_device():
    def span(dev, stream, start, end, worker=0, **kw):
        return {"device": dev, "stream": stream, "name": "x", "start_s": start, "end_s": end, "worker": worker, **kw}

    spans = [  # the step runs from 0 to 10 s
        span("cuda:0", "weights_in", 0.0, 2.0, bytes=100), span("cuda:0", "weights_in", 3.0, 5.0, bytes=50),
        span("cuda:0", "compute", 1.0, 4.0), span("cuda:0", "compute", 3.5, 6.0),     # overlapping: 1-6 s
        span("cuda:0", "acts_in", 1.0, 1.5, bytes=7), span("cuda:0", "host", 0.0, 9.0),
        span("cuda:1", "compute", 6.0, 10.0, worker=1), span("cuda:1", "out", 9.0, 9.5, worker=1, bytes=3),
    ]
    t = rpcompile_runner.trace_summary(spans)
    assert t["step_span_s"] == 10.0 and t["spans"] == len(spans)
    d0, d1 = t["devices"]["cuda:0"], t["devices"]["cuda:1"]
    assert d0["compute_busy_s"] == pytest.approx(5.0) and d0["compute_busy_frac"] == pytest.approx(0.5)
    # uploads 0-2 and 3-5 s: 1-2 and 3-5 under compute, 0-1 exposed
    assert d0["weights_in_s"] == pytest.approx(4.0) and d0["weights_in_overlapped_s"] == pytest.approx(3.0)
    assert d0["weights_in_exposed_s"] == pytest.approx(1.0)
    assert d0["bytes"] == {"weights_in": 150, "acts_in": 7}
    assert d1["compute_busy_frac"] == pytest.approx(0.4) and d1["weights_in_s"] == 0 and d1["bytes"] == {"out": 3}
    assert "compute_lag_s" not in d0          # no issue times recorded
    # Note [issue lag]: issued at 0.5 s for 0.2 s: queued 0.5 s, the device 3.3 s behind the host at the end;
    # issued at 3.4 s for 2.5 s: queued 0.1 s, the device 0.1 s behind
    lagged = [span("cuda:0", "compute", 1.0, 4.0, issued_s=0.5, issue_s=0.2),
              span("cuda:0", "compute", 3.5, 6.0, issued_s=3.4, issue_s=2.5), span("cuda:0", "out", 0.0, 1.0)]
    lag = rpcompile_runner.trace_summary(lagged)["devices"]["cuda:0"]["compute_lag_s"]
    assert lag == {"start": pytest.approx(0.3), "end": pytest.approx(1.7)}
    # CPU "devices" share the name "cpu": told apart by worker
    cpu = rpcompile_runner.trace_summary([span("cpu", "compute", 0, 1, worker=0), span("cpu", "compute", 0, 2, worker=1)])
    assert set(cpu["devices"]) == {"0:cpu", "1:cpu"}


def test_steady_busy_and_the_idle_time_between_steps():
    def span(dev, start, end, step, stream="compute"):
        return {"device": dev, "stream": stream, "name": "x", "start_s": start, "end_s": end, "worker": 0, "step": step}

    recent = [span("cuda:0", 0.0, 0.7, 0), span("cuda:0", 0.75, 1.45, 1), span("cuda:0", 1.5, 2.2, 2),
              span("cuda:0", 1.46, 1.5, 1, stream="out")]        # a download between steps: not compute
    steady = rpcompile_runner.steady_busy(recent)
    assert steady["period_s"] == pytest.approx(0.75)
    assert steady["compute_busy_frac"]["cuda:0"] == pytest.approx(0.7 / 0.75)
    assert steady["idle_between_steps_s"]["cuda:0"] == [pytest.approx(0.05), pytest.approx(0.05)]
    assert rpcompile_runner.steady_busy(recent[:1]) is None


# --- loss parity --------------------------------------------------------------------------------
def test_loss_parity_and_its_table():
    results = [
        {"system": "rpcompile", "status": "ok", "losses": [12.00, 11.90, 11.795]},
        {"system": "eager", "status": "ok", "losses": [12.00, 11.91, 11.79]},
        {"system": "far", "status": "ok", "losses": [12.00, 11.70, 11.80]},
        {"system": "nan", "status": "ok", "losses": [12.00, float("nan"), 11.80]},
        {"system": "short", "status": "timeout", "losses": [12.00]},
        {"system": "skipped", "status": "skipped", "reason": "skipped: needs CUDA"},
    ]
    ref, p = report.loss_parity(results, "eager", rtol=2.0**-7)
    assert ref == "eager" and set(p) == {"rpcompile", "eager", "far", "nan", "short"}
    assert p["rpcompile"]["max_abs_diff"] == pytest.approx(0.01) and p["rpcompile"]["max_abs_diff_step"] == 2
    assert p["rpcompile"]["within_tol"] and p["rpcompile"]["all_finite"]
    assert not p["far"]["within_tol"] and p["far"]["max_rel_diff"] == pytest.approx(0.21 / 11.91)
    assert not p["nan"]["within_tol"] and not p["nan"]["all_finite"] and p["nan"]["max_abs_diff"] is None
    assert not p["short"]["within_tol"] and p["short"]["steps_compared"] == 1       # not every step done
    assert report.loss_parity(results, "missing")[0] == "rpcompile"                  # first with losses
    assert report.loss_columns(20) == [1, 2, 5, 10, 20] and report.loss_columns(3) == [1, 2, 3]

    meta = {"mode": "losscurve", "settings": {"model": "qwen3-1.7b", "loss_steps": 3, "loss_reference": "eager",
                                              "loss_rtol": 2.0**-7, "lr": 1e-5, "seq_len": 2048}}
    text = report.render_run({"meta": meta, "results": results})
    assert "loss parity" in text.splitlines()[0] and "3 optimizer steps from step 1 (no warm-up)" in text
    rows = {c[0]: c for c in ([x.strip() for x in re.split(r"(?<!\\)\|", l)[1:-1]]
                              for l in text.splitlines() if l.startswith("| "))}
    col = {name: i for i, name in enumerate(rows["system"])}
    assert rows["rpcompile"][col["loss @2"]] == "11.9000" and rows["rpcompile"][col["within tol"]] == "yes"
    assert rows["eager"][col["within tol"]] == "(reference)" and rows["far"][col["within tol"]] == "NO"
    assert rows["nan"][col["all finite"]] == "NO" and rows["skipped"][col["notes"]] == "skipped: needs CUDA"
    assert "eager's loss moved -0.2100 from step 1 to step 3" in text


def test_loss_parity_mode_on_cpu(tmp_path):
    res, md, meta = _harness(tmp_path, "--gpus", "2", "--seq-len", "32", "--tokens-per-step", "256",
                             "--microbatches", "2", "--loss-steps", "5", "--timeout", "120",
                             "--systems", "rpcompile,eager,roundpipe")
    assert meta["mode"] == "losscurve" and meta["settings"]["loss_steps"] == 5 and meta["settings"]["lr"] == common.LR
    eager = res["eager"]["losses"]
    for name in ("rpcompile", "eager"):
        r = res[name]
        assert r["status"] == "ok", r.get("stderr_tail") or r.get("reason")
        assert len(r["losses"]) == 5 and all(math.isfinite(x) for x in r["losses"])
        assert r["warmup_steps"] == 0 and "tokens_per_s" not in r           # no warm-up, no throughput claim
        assert r["loss_parity"]["reference"] == "eager" and r["loss_parity"]["within_tol"]
    # Same initial weights, same batches, same AdamW: the curves differ only by rounding (eager: fp32
    # weights under bf16 autocast; rpcompile: bf16 working copies). The loss is a mean over 256
    # tokens, so it differs far less than bf16's 2^-8 relative rounding (about 1e-4 here). Held to
    # a tenth of how far eager's loss moves from one step to the next (~0.01: each step a new random
    # batch), the check also fails if a system trains on other batches or skips an update.
    swing = max(abs(b - a) for a, b in zip(eager, eager[1:]))
    assert swing > 0.005
    assert res["rpcompile"]["loss_parity"]["max_abs_diff"] < 0.1 * swing
    assert res["roundpipe"]["status"] == "skipped"
    assert "· loss parity" in md and "| rpcompile | ok |" in md and "(reference)" in md and "within tol:" in md


def test_harness_walks_no_large_process_unless_asked(tmp_path, monkeypatch):
    # Note [host memory without a walk]: /proc/PID/smaps_rollup holds the child's mmap lock while
    # it walks the page tables (read every 5 s, walks 40% of a 2-H200 Llama-3.1-8B run): by default the
    # peak comes from the kernel's counters every poll, and --pss-interval walks only when asked.
    # Every process counts as large here (small ones are walked: Note [forked processes' anonymous pages])
    monkeypatch.setattr(harness, "SMALL_ANON", 0)
    walks = []
    real = harness._rollup
    monkeypatch.setattr(harness, "_rollup", lambda pid: walks.append(pid) or real(pid))
    args = ("--systems", "simulated", "--option", "sleep=0.25", "--steps", "6", "--warmup", "1", "--timeout", "60")
    res, _, meta = _harness(tmp_path, *args)
    r = res["simulated"]
    assert r["status"] == "ok" and r["wall_s"] > 1.5       # the loop polled the child many times
    assert walks == [] and r["host_pss_peak_bytes"] is None
    # Note [a run's start]: what the host held as the run began, and the kernel's huge page settings
    assert r["host_at_launch_bytes"]["MemFree"] > 0 and r["anon_huge_peak_bytes"] >= 0
    assert set(meta["env"]["transparent_hugepage"]) <= {"enabled", "defrag", "shmem_enabled"}
    for key in ("host_cpu_timed_s", "host_cpu_setup_s"):     # the host's CPU seconds over the timed steps, the setup
        cpu = r[key]
        # (not idle > 0: a 2-core host busy with other work can leave none over a short window)
        assert set(cpu) == set(harness.CPU_KINDS) and sum(cpu.values()) > 0 and all(v >= 0 for v in cpu.values())
        assert sum(cpu.values()) < (os.cpu_count() or 1) * (r["wall_s"] + 1)
    assert r["host_rss_peak_bytes"] > 20 * 2**20            # an interpreter with torch, read from the counters
    parts = r["host_rss_peak_parts"]                         # what made the peak, and when it came
    assert parts["anon"] + parts["files"] + parts["shmem"] == r["host_rss_peak_bytes"]
    assert parts["processes"] >= 1 and 0 <= parts["at_s"] <= r["wall_s"]
    # (one timed step: the walk comes at the first poll, as the child starts, and no later one)
    res, _, _ = _harness(tmp_path, "--systems", "simulated", "--option", "sleep=0.25", "--steps", "1", "--warmup", "1",
                         "--timeout", "60", "--pss-interval", "1000")
    r = res["simulated"]
    assert len(walks) == 1 and r["host_pss_peak_bytes"] > 0   # the first poll's walk (the child just started)


def test_resident_bytes_from_a_kernel_that_does_not_split_them(monkeypatch):
    """Before Linux 4.5 /proc/PID/status has VmRSS but not RssAnon/RssFile/RssShmem: all of it
    counts as the process's own; a process the kernel says nothing of counts as none."""
    import io
    texts = {"1": "Name:\tpython\nVmRSS:\t  2048 kB\n", "2": "Name:\tpython\n"}
    monkeypatch.setattr(harness, "open", lambda path, *a, **k: io.StringIO(texts[path.split("/")[2]]), raising=False)
    assert harness._resident("1") == (2048 * 1024, 0, 0) and harness._resident("2") is None


_FORKING_GROUP = """
import os, time
anon = bytearray(os.urandom(1 << 20)) * 64                      # 64 MiB of anonymous pages, touched
for _ in range(3):                                              # forked: they share them until written
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux 4.14+")
def test_group_rss_counts_forked_processes_shared_pages_once(monkeypatch):
    """Note [forked processes' anonymous pages]: a process and three children forked after it
    wrote 64 MiB read about as their proportional set size, where each process's counters count
    the 64 MiB as its own; a process of at least SMALL_ANON is not walked."""
    import subprocess
    main = subprocess.Popen([sys.executable, "-c", _FORKING_GROUP], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert main.stdout.readline().strip() == "ready"
        pids = harness.group_pids(main.pid)
        each = sum(harness._resident(p)[0] for p in pids)
        parent = harness._resident(str(main.pid))[0]
        assert len(pids) == 4 and parent > 64 << 20 and each > 3.5 * parent
        anon, pss = harness.group_resident(main.pid)["anon"], harness.group_pss(main.pid)
        assert parent <= anon < 1.25 * parent, (anon, parent)
        assert abs(harness.group_rss(main.pid) - pss) < 0.1 * pss
        walks = []
        real = harness._rollup
        monkeypatch.setattr(harness, "_rollup", lambda pid: walks.append(pid) or real(pid))
        monkeypatch.setattr(harness, "SMALL_ANON", 0)
        assert harness.group_resident(main.pid)["anon"] == sum(harness._resident(p)[0] for p in pids) and not walks
    finally:
        harness.kill_group(main.pid, grace=1.0)
        main.wait()


_SHARING_GROUP = """
import mmap, os, subprocess, sys, time
size = 96 << 20
if sys.argv[1] == "main":
    anon = bytearray(os.urandom(1 << 20)) * 48                  # 48 MiB of anonymous pages
    fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, size)
    shared = mmap.mmap(fd, size)
    shared.write(b"x" * size)                                   # 96 MiB of shared memory, touched
    mapper = subprocess.Popen([sys.executable, "-c", sys.argv[3], "mapper", sys.argv[2], sys.argv[3]])
    mapper.wait()
else:                                                           # a worker: maps and reads the same file
    fd = os.open(sys.argv[2], os.O_RDWR)
    shared = mmap.mmap(fd, size)
    sum(shared[i] for i in range(0, size, 4096))
    print("ready", flush=True)
    time.sleep(60)
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.exists("/proc/self/status"), reason="Linux")
def test_group_rss_counts_shared_memory_once_as_pss_does(tmp_path):
    """Note [host memory without a walk]: a process and the worker it started, both mapping one
    96 MiB shared-memory file, read from the counters about as their proportional set size: the
    shared file once, not once per process."""
    import subprocess
    path = f"/dev/shm/rpcompile-test-{os.getpid()}"
    main = subprocess.Popen([sys.executable, "-c", _SHARING_GROUP, "main", path, _SHARING_GROUP],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert main.stdout.readline().strip() == "ready"
        rss, pss = harness.group_rss(main.pid), harness.group_pss(main.pid)
        shared_twice = sum(sum(harness._resident(p)) for p in harness.group_pids(main.pid))
        assert len(harness.group_pids(main.pid)) == 2
        assert rss > (96 + 48) << 20 and shared_twice > rss + (90 << 20)
        assert abs(rss - pss) < 0.1 * pss, (rss, pss)
    finally:
        harness.kill_group(main.pid, grace=1.0)
        main.wait()
        os.unlink(path)


def test_trace_hops_reports_each_microbatchs_hop_between_jobs():
    from benchmarks.trace_hops import summarize

    def compute(job, mb, worker, start, end):
        return {"device": f"cuda:{worker}", "stream": "compute", "name": "forward", "start_s": start,
                "end_s": end, "job": job, "microbatch": mb, "worker": worker}
    spans = [compute(0, 0, 0, 0.0, 0.1), compute(0, 1, 0, 0.1, 0.2),
             compute(1, 0, 1, 0.15, 0.25), compute(1, 1, 1, 0.25, 0.35)]
    text = summarize(spans)
    assert "  50.0" in text and "hops: 2, median 50.0 ms, max 50.0 ms" in text
    assert "compute span 0.350 s" in text and "cuda:0: 0.200 s" in text and "cuda:1: 0.200 s" in text


def test_beside_optimizer_sets_the_pieces_beside_the_updates_spans_apart():
    """benchmarks/beside_optimizer.py: a piece that overlaps the optimizer's device spans is counted
    there with its seconds over its key's median; the others alone; another device's spans do not count."""
    from benchmarks.beside_optimizer import report

    def piece(step, start, end, device="cuda:0"):
        return {"device": device, "stream": "compute", "name": "forward+backward", "start_s": start,
                "end_s": end, "job": 0, "microbatch": 0, "step": step}

    def opt(name, start, end, device="cuda:0"):
        return {"device": device, "stream": "optimizer", "name": name, "start_s": start, "end_s": end}
    spans = [piece(0, 0.0, 0.25), piece(1, 0.5, 1.0), piece(2, 1.25, 1.5), piece(3, 1.75, 2.0),
             opt("step_on_device", 0.5, 0.75), opt("masters_down", 0.625, 0.875),
             opt("copies_down", 1.0, 1.125, device="cuda:1")]
    lines = report(spans)
    assert lines[0].startswith("cuda:0: steps [0, 1, 2, 3], compute 1.250 s, optimizer spans step_on_device 1x 0.250 s")
    assert "  beside alone: 3 pieces, 0.750 s, excess over their keys' medians +0.000 s" in lines
    assert "  beside step_on_device+masters_down: 1 pieces, 0.500 s, excess over their keys' medians +0.250 s" in lines
    assert lines[-1].startswith("cuda:1: steps [], compute 0.000 s") and "copies_down 1x 0.125 s" in lines[-1]


# --- RESULTS.md's raw tables read back ------------------------------------------------------------
RESULTS_EXCERPT = """\
## 2026-11-26 03:37 UTC · NVIDIA H200 × 1 · qwen3-1.7b · loss parity

model qwen3-1.7b (1,720,574,976 parameters); seq 2,048; 65,536 tokens/step; 4 microbatches; 20 optimizer steps

| system | status | loss @1 | notes |
|---|---|---:|---|
| eager | ok | 12.3359 | fp32 weights |

## 2026-11-26 10:17 UTC · NVIDIA H200 × 4 · qwen3-1.7b · throughput

model qwen3-1.7b (1,720,574,976 parameters); seq 2,048; 65,536 tokens/step; 4 microbatches; 8 timed steps after 2 (rpcompile-delayed: 4) warm-up; bf16 compute, fp32 master weights and Adam, SDPA, random token ids as labels; recompute-inclusive ceiling 201,999 tokens/s at 790 TFLOP/s per GPU; torch 2.11.0+cu130, host 64 cores / 504 GiB.

| system | status | tokens/s | s/step | MFU | of ceiling | peak GPU mem | host mem peak | loss (first → last) | rpcompile ÷ system | setup s | notes |
|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|
| rpcompile-delayed | ok | 59,407 | 1.103 | 22.1% | 29.4% | 10.9 GiB | 70.9 GiB | 12.337 → 12.341 |  | 226 | Config(optimizer_mode='delayed'): gradients applied one step late, as RoundPipe's async step; plan: 9 stage jobs, weights up 7.22 GiB/step, grads down ≈3.78 GiB/step; compute busy (last step) cuda:0 50%, cuda:1 37%, cuda:2 48%, cuda:3 72% |
| roundpipe | ok | 40,174 | 1.631 | 14.9% | 19.9% | 48.5 GiB | 53.2 GiB | 12.336 → 12.340 |  | 42 |  |
| rpcompile-overlapped | timeout |  |  |  |  | 4.3 GiB | 258.7 GiB | 12.337 → 12.340 |  | 169 | timeout after 240 s; a \\| pipe |

Command: `python -m benchmarks.harness --model qwen3-1.7b --gpus 4 --steps 8 --systems rpcompile-delayed,roundpipe`

<details><summary>stderr of the systems that did not finish</summary>

| not | a | row |
</details>
"""


def test_results_md_tables_read_back_as_runs():
    from benchmarks.results_md import parse_results_md

    runs = parse_results_md(RESULTS_EXCERPT, source="RESULTS.md")
    assert len(runs) == 1                                      # the loss-parity section is not read
    meta, results = runs[0]["meta"], {r["system"]: r for r in runs[0]["results"]}
    assert (meta["date"], meta["card"], meta["gpus"], meta["mode"]) == ("2026-11-26 10:17 UTC", "NVIDIA H200", 4,
                                                                        "throughput")
    assert meta["settings"] == {"model": "qwen3-1.7b", "seq_len": 2048, "tokens_per_step": 65536,
                                "microbatches": 4, "steps": 8, "warmup": 2}
    assert meta["n_params"] == 1_720_574_976 and meta["command"].endswith("--systems rpcompile-delayed,roundpipe")
    assert set(results) == {"rpcompile-delayed", "roundpipe", "rpcompile-overlapped"}   # not the stderr's "row"
    d = results["rpcompile-delayed"]
    assert d["status"] == "ok" and d["tokens_per_s"] == 59_407 and d["s_per_step"] == 1.103 and d["setup_s"] == 226
    assert d["host_mem_peak_bytes"] == pytest.approx(70.9 * 2**30)
    assert d["compute_busy_frac"] == {"cuda:0": 0.5, "cuda:1": 0.37, "cuda:2": 0.48, "cuda:3": 0.72}
    assert d["timed_steps_done"] == 8 and "timed_step_s" not in d        # a table has no per-step times
    assert "compute_busy_frac" not in results["roundpipe"] and results["roundpipe"]["tokens_per_s"] == 40_174
    o = results["rpcompile-overlapped"]
    assert o["status"] == "timeout" and "tokens_per_s" not in o and "timed_steps_done" not in o
    assert "a | pipe" in o["notes"][0]


def test_every_throughput_table_of_the_repos_results_md_reads():
    from benchmarks.results_md import load_results_md

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "RESULTS.md")
    with open(path) as f:
        headings = [l for l in f if l.startswith("## ") and l.rstrip().endswith("· throughput")]
    runs = load_results_md(path)
    assert len(runs) == len(headings) > 0
    for run in runs:
        s = run["meta"]["settings"]
        assert s["seq_len"] > 0 and s["tokens_per_step"] > 0 and s["steps"] > 0 and run["meta"]["n_params"] > 0
        assert run["results"] and all(r["system"] and r["status"] for r in run["results"])


# --- issue 16's bar from the runs -----------------------------------------------------------------
def _bar_run(date, gpus, systems, model="qwen3-1.7b", card="NVIDIA H100 80GB HBM3", tokens=65536, seq=2048):
    return {"meta": {"date": date, "card": card, "gpus": gpus, "mode": "throughput", "n_params": 10**9,
                     "settings": {"model": model, "seq_len": seq, "tokens_per_step": tokens}},
            "results": [{"system": name, "status": "ok", **figures} for name, figures in systems.items()]}


def _delayed(tokens_per_s, gpus, **over):
    """A rpcompile-delayed result that meets every row of the bar, unless `over` says otherwise."""
    return {"tokens_per_s": tokens_per_s, "timed_step_s": [1.0] * 7 + [1.2], "timed_steps_done": 8,
            "compute_busy_frac": {f"cuda:{i}": 0.9 for i in range(gpus)}, "host_mem_peak_bytes": 18e9,
            "setup_s": 50.0, "s_per_step": 1.0,
            "info": {"optimizer_s": {"grads_s": 0.3, "clip_s": 0.0, "step_s": 0.5, "refresh_s": 0.2}}, **over}


def _fast(tokens_per_s):
    return {"tokens_per_s": tokens_per_s, "timed_steps_done": 8}


def _passing_runs(model):
    # 1 -> 4 GPUs: 37,000 / 10,000 = 3.7x; RoundPipe at 60% of rpcompile-delayed: 1.67x
    return [_bar_run(f"2026-12-01 0{n}:00 UTC", n, {"rpcompile-delayed": _delayed(t, n), "roundpipe": _fast(0.6 * t),
                                                     "rpcompile": _fast(t), "rpcompile-overlapped": _fast(t)}, model)
            for n, t in ((1, 10_000), (2, 19_000), (4, 37_000))]


REFERENCE = {(m, s, n): 9_000 for m in ("qwen3-1.7b", "llama3.1-8b") for s in ("rpcompile", "rpcompile-overlapped")
             for n in (1, 4)}


def _bar_row(rows, key, gpus="1", model="qwen3-1.7b"):
    found = [r for r in rows if key in r.item and r.model == model and r.gpus == gpus]
    assert len(found) == 1, (key, gpus, model, [r.item for r in rows])
    return found[0]


def test_bar_holds_when_every_row_does(tmp_path):
    runs = _passing_runs("qwen3-1.7b") + _passing_runs("llama3.1-8b")
    rows = bar.evaluate(runs, reference=REFERENCE)
    assert {r.verdict for r in rows} == {"holds"}, [(r.item, r.gpus, r.figure) for r in rows if r.verdict != "holds"]
    # per model: workload, 3 ratios, scaling, busy, 3 slowest, 3 host memory, 3 optimizer, 4 exact; setup for
    # Qwen only; then one timed-steps row per run used
    assert len(rows) == 2 * 19 + 1 + 6
    assert _bar_row(rows, "host optimizer", "2").figure == "0.70 (0.700 s / 1.000 s)"
    assert _bar_row(rows, "÷ RoundPipe", "4").figure == "1.67× (37,000 / 22,200 tokens/s)"
    assert _bar_row(rows, "scaling", "1 → 4").figure == "3.70× (37,000 / 10,000 tokens/s)"
    assert _bar_row(rows, "slowest", "2").figure.startswith("1.20 (1.200 s / median 1.000 s)")
    assert _bar_row(rows, "host memory", "4").figure.startswith("18.0 B/param")
    assert "2026-12-01 04:00 UTC, NVIDIA H100 80GB HBM3 × 4" in bar.render(rows)
    # the command line: --strict exits 0 when nothing misses
    for run in runs:
        run_files.write_run(str(tmp_path), run)
    assert bar.main(["--runs", str(tmp_path), "--results", "", "--strict"]) == 0


def test_bar_rows_that_miss(tmp_path, capsys):
    runs = _passing_runs("qwen3-1.7b")
    slow = _delayed(25_000, 4, compute_busy_frac={"cuda:0": 0.9, "cuda:1": 0.6, "cuda:2": 0.9, "cuda:3": 0.9},
                    timed_step_s=[1.0, 1.0, 1.0, 1.5], timed_steps_done=4, host_mem_peak_bytes=40e9, setup_s=90.0,
                    info={"optimizer_s": {"grads_s": 0.1, "clip_s": 0.1, "step_s": 0.8, "refresh_s": 0.3}})
    # newest 4-GPU run: RoundPipe close behind, scaling 2.5x; an older, better one is not read
    runs.append(_bar_run("2026-12-02 00:00 UTC", 4, {"rpcompile-delayed": slow, "roundpipe": _fast(20_000),
                                                     "rpcompile": _fast(9_000), "rpcompile-overlapped": _fast(8_000)}))
    rows = bar.evaluate(runs, reference=REFERENCE)
    miss = {(r.item.split(" (")[0], r.gpus) for r in rows if r.verdict == "misses" and r.model == "qwen3-1.7b"}
    assert _bar_row(rows, "÷ RoundPipe", "4").figure.startswith("1.25×")
    assert _bar_row(rows, "compute busy", "4").figure.startswith("60% lowest")
    assert _bar_row(rows, "slowest", "4").figure.startswith("1.50")
    assert _bar_row(rows, "host memory", "4").figure.startswith("40.0 B/param")
    assert _bar_row(rows, "first steps", "4").figure == "90 s"
    assert {("rpcompile-delayed ÷ RoundPipe, same run", "4"), ("scaling 1 → 4 GPUs", "1 → 4"),
            ("compute busy on every GPU", "4"), ("slowest timed step ÷ median", "4"),
            ("host memory peak per parameter", "4"), ("first steps at 4 GPUs: capture, plan, compile", "4"),
            ("host optimizer seconds per step ÷ step seconds", "4"),
            ("exact mode", "4"), ("overlapped mode", "4"), ("timed steps after warm-up, every run used above", "4")} == miss
    assert _bar_row(rows, "÷ RoundPipe", "1").verdict == "holds"       # the other GPU counts are untouched
    # exact modes: "no slower" on 1 GPU holds at the reference, "faster" on 4 does not
    at_ref = bar.evaluate(runs, reference={("qwen3-1.7b", "rpcompile", 1): 10_000, ("qwen3-1.7b", "rpcompile", 4): 9_000})
    assert _bar_row(at_ref, "exact mode", "1").verdict == "holds" and _bar_row(at_ref, "exact mode", "4").verdict == "misses"

    for run in runs:
        run_files.write_run(str(tmp_path), run)
    assert bar.main(["--runs", str(tmp_path), "--results", ""]) == 0          # a report ...
    assert "**misses**" in capsys.readouterr().out
    assert bar.main(["--runs", str(tmp_path), "--results", "", "--strict"]) == 1   # ... unless --strict


def test_bar_reads_no_run_with_an_option_that_changes_the_system():
    """A run with a share of the optimizer set (an experiment) is not the system a user gets: the
    rows read the newest run without one; a trace directory only observes, so such a run counts."""

    runs = _passing_runs("qwen3-1.7b")
    newer = _bar_run("2026-12-02 00:00 UTC", 2, {"rpcompile-delayed": _delayed(19_000, 2, host_mem_peak_bytes=9e9)})
    newer["meta"]["settings"]["options"] = {"rpcompile_optimizer_on_devices": "1.0"}
    rows = bar.evaluate(runs + [newer], reference=REFERENCE)
    assert _bar_row(rows, "host memory", "2").figure.startswith("18.0 B/param")
    newer["meta"]["settings"]["options"] = {"rpcompile_trace_dir": "trace"}
    rows = bar.evaluate(runs + [newer], reference=REFERENCE)
    assert _bar_row(rows, "host memory", "2").figure.startswith("9.0 B/param")


def test_bar_reads_no_host_peak_the_counters_may_have_overcounted():
    """Note [forked processes' anonymous pages] (harness.py): a peak from the counters that counted
    a compile pool's forked workers' shared pages per process, above the host's used memory, is not
    read; the same counters' peak below the used memory is (the used memory set the figure), and so
    is a peak from counters that count such pages once."""

    runs = _passing_runs("qwen3-1.7b")
    over = dict(host_mem_peak_bytes=36e9, host_rss_peak_bytes=36e9, host_used_peak_bytes=27e9,
                host_rss_peak_parts={"anon": 20e9, "files": 1e9, "shmem": 15e9, "processes": 37})
    newer = _bar_run("2026-12-02 00:00 UTC", 2, {"rpcompile-delayed": _delayed(19_000, 2, **over)})
    rows = bar.evaluate(runs + [newer], reference=REFERENCE)
    assert _bar_row(rows, "host memory", "2").figure.startswith("18.0 B/param")      # the older run's
    assert _bar_row(rows, "÷ RoundPipe", "2").verdict == "holds"                     # other rows untouched
    for fix in ({"host_rss_forks_once": True}, {"host_rss_peak_bytes": 20e9, "host_mem_peak_bytes": 27e9}):
        newer["results"][0].update(fix)
        rows = bar.evaluate(runs + [newer], reference=REFERENCE)
        assert _bar_row(rows, "host memory", "2").figure.startswith(f"{newer['results'][0]['host_mem_peak_bytes'] / 1e9:.1f} B/param")


def test_bar_reads_no_result_whose_host_lost_its_cpu_to_steal(tmp_path, capsys):
    """Note [stolen host] (bar.py): a result whose host gave more than 2% of its CPU seconds over
    the timed steps to steal is not read, and the printout names it; 0.1% is read."""

    runs = _passing_runs("llama3.1-8b")
    cpu = {"user": 439.0, "nice": 0.0, "system": 48.9, "idle": 983.8, "iowait": 0.0, "irq": 0.0, "softirq": 2.3}
    newer = _bar_run("2026-12-02 00:00 UTC", 2, {"rpcompile-delayed": _delayed(18_193, 2, host_cpu_timed_s={
        **cpu, "steal": 105.7}, host_mem_peak_bytes=9e9), "roundpipe": _fast(10_000)}, model="llama3.1-8b")
    rows = bar.evaluate(runs + [newer], reference=REFERENCE)
    for key in ("host memory", "÷ RoundPipe", "host optimizer"):    # the older run's, not the stolen one
        assert [r for r, _ in _bar_row(rows, key, "2", "llama3.1-8b").sources] == [runs[1]]
    assert _bar_row(rows, "÷ RoundPipe", "2", "llama3.1-8b").figure.startswith("1.67×")
    run_files.write_run(str(tmp_path), newer)
    bar.main(["--runs", str(tmp_path), "--results", ""])
    assert "left out, steal took 6.7% of the host's CPU over the timed steps (> 2%): rpcompile-delayed, " \
           "2026-12-02 00:00 UTC, NVIDIA H100 80GB HBM3 × 2" in capsys.readouterr().out
    newer["results"][0]["host_cpu_timed_s"]["steal"] = 1.5
    rows = bar.evaluate(runs + [newer], reference=REFERENCE)
    assert _bar_row(rows, "host memory", "2", "llama3.1-8b").figure.startswith("9.0 B/param")
    # steal over the setup (it sets the setup row's figure) leaves the result out as well
    newer["results"][0]["host_cpu_setup_s"] = {"user": 900.0, "idle": 2000.0, "steal": 100.0}
    rows = bar.evaluate(runs + [newer], reference=REFERENCE)
    assert _bar_row(rows, "host memory", "2", "llama3.1-8b").figure.startswith("18.0 B/param")
    assert bar.stolen_lines(runs + [newer])[0].startswith("left out, steal took 3.3% of the host's CPU over the setup")
    assert bar.stolen({}) is None and bar.stolen({"host_cpu_timed_s": {"idle": 0.0}}) is None


def test_bar_reads_no_result_whose_plan_the_hosts_memory_bound():
    """A one-GPU result on a host too small for the default plan (the optimizer's share raised
    for it: harness info host_share_least > 0) measures that host: the scaling row reads the
    older one, and the printout names it; a result with nothing raised is read."""

    runs = _passing_runs("llama3.1-8b")
    small = _bar_run("2026-12-02 00:00 UTC", 1, {"rpcompile-delayed": _delayed(8_000, 1, info={
        "optimizer_s": {"grads_s": 0.3, "clip_s": 0.0, "step_s": 0.5, "refresh_s": 0.2}, "host_share_least": 0.5})},
        model="llama3.1-8b")
    rows = bar.evaluate(runs + [small], reference=REFERENCE)
    assert _bar_row(rows, "scaling", "1 → 4", "llama3.1-8b").figure == "3.70× (37,000 / 10,000 tokens/s)"
    assert bar.stolen_lines(runs + [small]) == [
        "left out, the host's memory bound its plan (a share of at least 0.5 of the optimizer on the GPUs): "
        "rpcompile-delayed, 2026-12-02 00:00 UTC, NVIDIA H100 80GB HBM3 × 1"]
    small["results"][0]["info"]["host_share_least"] = 0.0
    rows = bar.evaluate(runs + [small], reference=REFERENCE)
    assert _bar_row(rows, "scaling", "1 → 4", "llama3.1-8b").figure == "4.62× (37,000 / 8,000 tokens/s)"


def test_bar_says_not_measured_where_data_is_missing():
    one = _delayed(10_000, 1)
    del one["timed_step_s"], one["compute_busy_frac"]
    four = _delayed(30_000, 4, compute_busy_frac={"cuda:0": 0.95, "cuda:1": 0.95, "cuda:2": 0.95})   # a GPU idle
    del four["timed_step_s"], four["setup_s"]
    runs = [_bar_run("2026-12-01 01:00 UTC", 1, {"rpcompile-delayed": one, "rpcompile": _fast(10_000)}),
            _bar_run("2026-12-01 04:00 UTC", 4, {"rpcompile-delayed": four}),
            _bar_run("2026-12-01 05:00 UTC", 4, {"rpcompile-delayed": _delayed(99_000, 4)}, seq=4096),   # not seq 2048
            _bar_run("2026-12-01 06:00 UTC", 2, {"rpcompile-delayed": _delayed(19_000, 2)}, card="CPU")]  # not a GPU
    rows = bar.evaluate(runs)                                     # the issue's reference figures: none known
    assert _bar_row(rows, "÷ RoundPipe", "1").verdict == "not measured" and _bar_row(rows, "÷ RoundPipe", "1").figure == "no run"
    assert _bar_row(rows, "slowest", "1").figure == "per-step times not recorded"
    assert _bar_row(rows, "slowest", "1").verdict == "not measured"
    assert _bar_row(rows, "slowest", "2").figure == "no run"
    assert _bar_row(rows, "first steps", "4").verdict == "not measured"
    busy = _bar_row(rows, "compute busy", "4")          # three GPUs in the trace: the fourth did no compute
    assert busy.verdict == "misses" and "1 GPU(s) not in the trace" in busy.figure
    assert _bar_row(rows, "scaling", "1 → 4").figure.startswith("3.00×")          # 30,000 / 10,000, seq 2048 only
    assert _bar_row(rows, "workload", "1, 2, 4").verdict == "not measured"       # no 2-GPU run counts
    assert _bar_row(rows, "exact mode", "1").verdict == "no reference"
    assert _bar_row(rows, "exact mode", "1").figure == "10,000 tokens/s"
    assert _bar_row(rows, "exact mode", "4").verdict == "not measured"
    assert all(r.verdict == "not measured" for r in rows if r.model == "llama3.1-8b")
    # a row reads the newest run that has its figure: an older run with per-step times over a newer table
    older = _bar_run("2026-11-30 01:00 UTC", 1, {"rpcompile-delayed": _delayed(9_000, 1, timed_step_s=[1.0, 1.1, 1.0])})
    row = _bar_row(bar.evaluate(runs + [older]), "slowest", "1")
    assert row.figure.startswith("1.10") and row.verdict == "holds" and [r for r, _ in row.sources] == [older]
    # the workload misses when the GPU counts ran different tokens per step
    runs.append(_bar_run("2026-12-01 07:00 UTC", 2, {"rpcompile-delayed": _delayed(19_000, 2)}, tokens=32768))
    assert _bar_row(bar.evaluate(runs), "workload", "1, 2, 4").verdict == "misses"


def test_bar_never_forms_a_ratio_across_two_runs():
    newer = _bar_run("2026-12-01 05:00 UTC", 4, {"rpcompile-delayed": _delayed(40_000, 4)})
    older = _bar_run("2026-12-01 04:00 UTC", 4, {"roundpipe": _fast(10_000)})
    rows = bar.evaluate([newer, older])
    assert _bar_row(rows, "÷ RoundPipe", "4").verdict == "not measured" and not _bar_row(rows, "÷ RoundPipe", "4").sources
    # a run that has both is read, even an older one, and only it
    both = _bar_run("2026-12-01 03:00 UTC", 4, {"rpcompile-delayed": _delayed(30_000, 4), "roundpipe": _fast(25_000)})
    row = _bar_row(bar.evaluate([newer, older, both]), "÷ RoundPipe", "4")
    assert row.figure.startswith("1.20×") and row.verdict == "misses" and [r for r, _ in row.sources] == [both]
    # scaling pairs runs only on the same card and at the same tokens per step
    other_card = _bar_run("2026-12-01 01:00 UTC", 1, {"rpcompile-delayed": _delayed(10_000, 1)}, card="NVIDIA H200")
    other_tokens = _bar_run("2026-12-01 02:00 UTC", 1, {"rpcompile-delayed": _delayed(10_000, 1)}, tokens=32768)
    assert _bar_row(bar.evaluate([newer, other_card, other_tokens]), "scaling", "1 → 4").verdict == "not measured"


def test_bar_reads_a_run_once_when_its_file_and_its_table_both_exist():
    recorded = _bar_run("2026-12-01 04:00 UTC", 4, {"rpcompile-delayed": _delayed(40_000, 4)})
    table = json.loads(json.dumps(recorded))
    table["meta"]["source"] = "benchmarks/RESULTS.md"
    other = _bar_run("2026-12-01 03:00 UTC", 4, {"rpcompile-delayed": _delayed(30_000, 4)})
    merged = bar.merge([recorded], [table, other])
    assert merged == [recorded, other]                           # newest first, the file's copy kept


def test_bar_keeps_the_ends_drain_out_of_the_slowest_step():
    """The last timed step includes the wait at the end for the asynchronous optimizer's last
    step (drain_s): the slowest / median row compares the steps without it and prints it."""

    steps = [1.0] * 7 + [1.8]
    drained = _bar_run("2026-12-01 02:00 UTC", 2, {"rpcompile-delayed": _delayed(19_000, 2, timed_step_s=steps,
                                                                                 drain_s=0.75)})
    row = _bar_row(bar.evaluate([drained]), "slowest", "2")
    assert row.verdict == "holds" and "drain of 0.750 s" in row.figure and row.figure.startswith("1.05 ")
    undrained = _bar_run("2026-12-01 02:00 UTC", 2, {"rpcompile-delayed": _delayed(19_000, 2, timed_step_s=steps)})
    assert _bar_row(bar.evaluate([undrained]), "slowest", "2").verdict == "misses"


def test_throughput_loop_reports_the_drain(tmp_path):
    """run_trainer's throughput loop times the end's finish() on its own (drain_s)."""
    from benchmarks import common

    class Slow(common.Trainer):
        def step(self, ids):
            return 1.0

        def finish(self):
            time.sleep(0.2)

    spec = common.RunSpec(system="eager", model="tiny", seq_len=8, tokens_per_step=16, steps=2, warmup=1,
                          result_path=str(tmp_path / "r.json"), device="cpu")
    common.run_trainer(lambda *a, **k: Slow(), spec, common.Recorder(spec.result_path))
    raw = json.loads((tmp_path / "r.json").read_text())
    assert raw["drain_s"] >= 0.2 and raw["steps"][-1]["s"] >= raw["drain_s"]


def test_shared_files_are_counted_by_the_process_that_made_them(tmp_path):
    import os

    from benchmarks.systems.rpcompile_runner import shared_files

    me, other = os.getpid(), os.getpid() + 1
    for name, size in ((f"{me}-0", 4096), (f"{me}-1", 1000), (f"{other}-0", 1 << 20), ("w0.sock", 0)):
        with open(tmp_path / name, "wb") as f:
            f.write(b"x" * size)
    out = shared_files(str(tmp_path))
    assert set(out) == {"main", f"worker {other}"}
    assert out["main"]["files"] == 2 and out["main"]["bytes"] == 5096
    assert out[f"worker {other}"]["bytes"] == 1 << 20 and out[f"worker {other}"]["resident_bytes"] >= 1 << 20


def test_table_ratio_is_of_the_rpcompile_system_that_ran():
    """Without a plain rpcompile run the ratio column divides the first rpcompile system's
    tokens/s (rpcompile-delayed beside RoundPipe) by each system's, and says so in its header."""
    text = report.render_throughput_table([{"system": "rpcompile-delayed", "status": "ok", "tokens_per_s": 26266.0},
                                           {"system": "roundpipe", "status": "ok", "tokens_per_s": 14640.0}])
    header, _, delayed, rp = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()]
    col = header.index("rpcompile-delayed ÷ system")
    assert rp[col] == "1.79×" and delayed[col] == "—"
    # the max-length table too (57,344 against 22,528 tokens on one H100 under 24 GiB)
    text = report.render_maxseq_table([{"system": "rpcompile-delayed", "status": "ok", "max_seq": 57344},
                                       {"system": "roundpipe", "status": "ok", "max_seq": 22528}])
    header, _, delayed, rp = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()]
    assert rp[header.index("rpcompile-delayed ÷ system")] == "2.55×"


def test_oom_detail_keeps_what_was_asked_and_the_allocators_figures():
    from benchmarks.common import oom_detail
    msg = ("CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
           "115.42 GiB is free. Of the allocated memory 11.77 GiB is allocated by PyTorch, and 11.66 GiB is "
           "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting ...")
    try:
        try:
            raise RuntimeError(msg)
        except RuntimeError as inner:
            raise ValueError("stage 4 (bwd) failed") from inner
    except ValueError as e:
        got = oom_detail(e)
    assert got.startswith("out of memory: Tried to allocate 1.75 GiB") and "11.66 GiB is reserved" in got
    assert "If reserved" not in got
    assert oom_detail(ValueError("CUDA out of memory")) == "out of memory"


def test_exact_mode_rows_read_the_issues_tree_in_the_same_run():
    """A run that also ran a mode at the issue's tree (system@ISSUE_TREE) is the row's reference,
    before any reference figure; the newest such run counts."""

    ref = f"rpcompile@{bar.ISSUE_TREE}"
    runs = [_bar_run("2026-12-02 01:00 UTC", 1, {"rpcompile": _fast(10_000), ref: _fast(12_000),
                                                  "rpcompile-overlapped": _fast(9_000)}),
            _bar_run("2026-12-01 01:00 UTC", 1, {"rpcompile": _fast(8_000), ref: _fast(7_000)})]
    rows = bar.evaluate(runs, reference={("qwen3-1.7b", "rpcompile", 1): 1_000})
    exact = _bar_row(rows, "exact mode", "1")
    assert exact.verdict == "misses" and exact.figure == "10,000 tokens/s" and "12,000 tokens/s, same run" in exact.bar
    assert _bar_row(rows, "overlapped mode", "1").verdict == "no reference"     # no overlapped run at the issue's tree
    rows = bar.evaluate(runs[1:])
    assert _bar_row(rows, "exact mode", "1").verdict == "holds"


def test_pinned_tensors_names_what_holds_each_storage(monkeypatch):
    """benchmarks.common.pinned_tensors: live pinned tensors grouped by storage, largest first,
    each with the attribute or key that holds it (pinned here: a stand-in for is_pinned)."""
    class Holder:
        pass

    holder = Holder()
    holder.buf = torch.zeros(1000)
    view = holder.buf[10:20]                  # a view: the same storage, counted once
    keyed = {"slot": torch.zeros(7, dtype=torch.float64)}
    mine = {id(holder.buf), id(view), id(keyed["slot"])}
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: id(self) in mine)
    found = common.pinned_tensors(limit=4)
    assert found["storages"] == 2 and found["found_bytes"] == 4000 + 56
    (n0, shape0, _, count0, owner0), (n1, _, dtype1, _, owner1) = found["largest"]
    assert (n0, shape0, count0, n1, dtype1) == (4000, [1000], 2, 56, "torch.float64")
    assert "Holder[buf]" in owner0 and owner1 == "dict[slot]"


def test_setup_timeline_reads_a_run_file(tmp_path, capsys):
    """benchmarks.setup_timeline prints a run's marks in order and the longest waits of each
    process (Note [setup timeline])."""
    from benchmarks import setup_timeline

    marks = [{"t": 0.0, "where": "main", "what": "first call", "seconds": None},
             {"t": 1.0, "where": "worker 0", "what": "imported", "seconds": None},
             {"t": 14.0, "where": "main", "what": "captured", "seconds": 13.5},
             {"t": 20.0, "where": "worker 0", "what": "plan loaded", "seconds": 0.1},
             {"t": 21.0, "where": "main", "what": "train_step returned", "seconds": None}]
    run = [{"results": [{"system": "roundpipe", "info": {}},
                        {"system": "rpcompile-delayed", "info": {"setup_timeline": marks}}]}]
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert setup_timeline.load(str(path), "rpcompile-delayed") == marks
    assert setup_timeline.gaps(marks, 2) == [(19.0, "worker 0", "imported", "plan loaded", 1.0),
                                             (14.0, "main", "first call", "captured", 0.0)]
    setup_timeline.main([str(path), "--gaps", "1"])
    out = capsys.readouterr().out
    assert "captured" in out and "13.50" in out and "19.00 s  worker 0" in out and "14.00 s" not in out
    with pytest.raises(SystemExit):
        setup_timeline.load(str(path), "eager")


def test_widen_probe_steps_each_slice_size_in_turn(monkeypatch, capsys):
    """benchmarks/widen_probe.py: the real FlatStepper over bf16 gradients, every WIDEN asked for
    stepped `reps` times (its rows printed), and FlatStepper.WIDEN as it was afterwards."""
    from benchmarks import widen_probe
    from rpcompile.runtime.flat import FlatStepper

    monkeypatch.setattr(widen_probe, "_shapes", lambda n: [(64, 32), (32,), (128, 16)])
    seen = []
    real = FlatStepper.step
    monkeypatch.setattr(FlatStepper, "step", lambda self, ps, gs: seen.append(FlatStepper.WIDEN) or real(self, ps, gs))
    default = FlatStepper.WIDEN
    assert widen_probe.main(["--params", "1", "--widen", "10,6", "--reps", "2"]) == 0
    assert seen == [default, 1 << 10, 1 << 6, 1 << 10, 1 << 6]          # the first step, then sizes in turn
    assert FlatStepper.WIDEN == default
    out = capsys.readouterr().out
    assert "WIDEN 2^10" in out and "WIDEN 2^6 " in out and "0.00B elements" in out


def test_device_peaks_take_the_worker_processes_in():
    """With worker processes the child's own allocator sees none of the devices' memory: each
    worker reports its device's peaks with every landed job (0 off CUDA), and the run's peaks are
    the largest over the child and the workers' reports (info's peak_gpu_workers)."""
    import rpcompile
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from models import MLP

    # (an MLP: its jobs land on both workers as a Qwen3's do, and its capture takes a tenth of the time)
    cm = rpcompile.compile(MLP(), rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2, workers="processes",
                                                   loss_fn=torch.nn.functional.mse_loss))
    assert cm.runner.executor.worker_device_peaks() == {}
    cm.train_step(torch.randn(8, 8), target=torch.randn(8, 4))
    assert cm.runner.executor.worker_device_peaks() == {"0:cpu": [0, 0], "1:cpu": [0, 0]}
    workers = {"peak_gpu_workers": {"0:cuda:0": [30, 50], "1:cuda:1": [40, 45]}}
    assert harness._peak(10, workers, 0) == 40 and harness._peak(10, workers, 1) == 50
    assert harness._peak(None, workers, 0) == 40 and harness._peak(100, workers, 1) == 100
    assert harness._peak(10, {}, 0) == 10 and harness._peak(None, {"peak_gpu_workers": {}}, 1) is None


# --- the any-model sweep ------------------------------------------------------------------------
def test_the_lora_sweep_compares_the_adapters_of_a_family_with_eager_peft():
    """`model_sweep --lora R`: a family as a peft model, LoRA on its linear layers, its stacked
    experts and router (a transformers MoE), trained one step against eager peft; what it
    compares are the adapters' gradients, the base frozen."""
    from benchmarks import model_sweep
    res = model_sweep.run_family("qwen3_moe", lora=4)
    assert res["status"] == "ok", res
    assert 0 < res["adapter_params"] < res["params"] / 2
    assert ".lora_" in res["worst_grad"] and res["grad_rel_err"] <= model_sweep.GRAD_RTOL
