"""The benchmark harness: FLOP formula, table writer, max-length search, and the harness end to
end on CPU (rpcompile and eager on the tiny model; GPU-only systems reported as skipped; a
failing, a slow and a crashing pretend system recorded without stopping the harness)."""
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # `pytest` as well as `python -m pytest`
from benchmarks import common, harness, report  # noqa: E402


# --- FLOPs and parameter counts ----------------------------------------------------------------
def test_param_count_by_hand():
    # Qwen3-1.7B: tied 151936 x 2048 embedding; per layer q 2048x2048, k and v 2048x1024, o 2048x2048,
    # gate/up/down 3 x 2048x6144, two RMSNorms of 2048 and q_norm/k_norm of 128; a final norm.
    layer = 2048 * 2048 + 2 * 2048 * 1024 + 2048 * 2048 + 3 * 2048 * 6144 + 2 * 2048 + 2 * 128
    assert common.param_count(common.get_model("qwen3-1.7b")) == 151936 * 2048 + 28 * layer + 2048 == 1_720_574_976
    # Llama-3.1-8B: untied, so embedding and LM head both count; no q/k norms.
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert common.param_count(common.get_model("llama3.1-8b")) == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
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
def _harness(tmp_path, *args):
    out, js = tmp_path / "RESULTS.md", tmp_path / "results.json"
    harness.main(["--model", "tiny", "--device", "cpu", "--out", str(out), "--json", str(js), *args])
    runs = json.loads(js.read_text())
    return {r["system"]: r for r in runs[-1]["results"]}, out.read_text(), runs[-1]["meta"]


def test_harness_runs_rpcompile_and_eager_on_cpu(tmp_path):
    res, md, meta = _harness(tmp_path, "--gpus", "2", "--seq-len", "32", "--tokens-per-step", "256",
                             "--microbatches", "2", "--steps", "2", "--warmup", "1", "--timeout", "120",
                             "--systems", "rpcompile,eager,roundpipe,fsdp2")
    for name in ("rpcompile", "eager"):
        r = res[name]
        assert r["status"] == "ok", r.get("stderr_tail") or r.get("reason")
        assert r["tokens_per_step"] == 256 and r["tokens_per_s"] > 0
        assert len(r["losses"]) == 3 and r["losses_finite"]
        assert r["n_params"] == common.param_count(common.get_model("tiny"))
        assert r["host_rss_peak_bytes"] > 0 and r["host_mem_peak_bytes"] >= r["host_rss_peak_bytes"]
        assert r["timed_steps_done"] == 2
    assert res["rpcompile"]["info"]["stage_jobs"] >= 1 and "rpcompile plan" in res["rpcompile"]["info"]["plan"]
    assert res["rpcompile"]["trace"]["count"]["compute/forward"] >= 1      # cm.last_trace, summed per stream
    # same weights, same batches: the first loss agrees (bf16 compute both ways)
    assert res["rpcompile"]["losses"][0] == pytest.approx(res["eager"]["losses"][0], abs=0.05)
    for name in ("roundpipe", "fsdp2"):
        assert res[name]["status"] == "skipped" and res[name]["reason"] == "skipped: needs CUDA"
    assert meta["card"] == "CPU" and meta["settings"]["microbatches"] == 2
    assert md.startswith("# Benchmark results") and "| rpcompile | ok |" in md and "| eager | ok |" in md


def test_harness_records_failures_and_timeouts_and_goes_on(tmp_path):
    res, md, _ = _harness(tmp_path, "--systems", "simulated", "--option", "fail=step", "--timeout", "60")
    r = res["simulated"]
    assert r["status"] == "failed" and "simulated failure in a step" in r["reason"]
    assert "simulated failure in a step" in r["stderr_tail"] and "<details>" in md

    res, _, _ = _harness(tmp_path, "--systems", "simulated", "--option", "sleep=0.2", "--steps", "40",
                         "--warmup", "1", "--timeout", "3")
    r = res["simulated"]
    assert r["status"] == "timeout" and r.get("partial") and r["tokens_per_s"] > 0   # what it measured is kept


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
