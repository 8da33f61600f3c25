"""Any-model sweep: every causal-LM family of transformers, tiny and random, trained one step
with rpcompile on CPU devices and compared with eager PyTorch.

    python -m benchmarks.model_sweep                       # all families, 120 s each
    python -m benchmarks.model_sweep --only llama,gpt2     # some of them (merged into the results)
    python -m benchmarks.model_sweep --resume              # only those not yet in results.json
    python -m benchmarks.model_sweep --report              # rewrite results.md from results.json
    python -m benchmarks.model_sweep --lora 8              # LoRA of rank 8 on every family (results_lora.*)

Each family runs in a child process (`--child TYPE OUT.json`) with a time limit, so a hang or a
crash costs that family only. The child builds the family's config class from its defaults,
shrunk (shrink_config: hidden 64, 2 layers, 4 heads, vocab 128, 4 experts, dropout 0), a
model from it (seed 0) and a copy; the copy runs eager forward + backward on a batch of 4 rows
x 16 tokens with some labels -100, the model one `cm.train_step` of
`Config(devices=["cpu", "cpu"], num_microbatches=2)`. ok: loss within rel 1e-5 and every
gradient within 1e-5 of the largest eager gradient. A family whose plan is one job (nothing cut)
trains again under a memory budget 15% above the smallest that fits, which pipelines it where it
can be cut ("tight" in the results; a mismatch or error there is `mismatch_tight`,
`rpcompile_error_tight`). VARIANTS runs a family again with other settings ("big_bird+original_full").
Per-family quirks of the configs are in QUIRKS; the triage of what is not ok in NOTES.
Results: benchmarks/runs/model_sweep/results.json and results.md.

With `--lora R` each family is a peft model first, LoRA of rank R on all its linear layers but
the output layer (`target_modules="all-linear"`, which takes a transformers MoE's stacked experts
too), its adapters initialised at random (`init_lora_weights=False`, so that both factors get a
gradient), the base frozen: what a user who LoRA-tunes the family runs. ok compares the loss
and the adapters' gradients, as above. Results: results_lora.json and results_lora.md.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "runs", "model_sweep")
ROWS, SEQ, VOCAB = 4, 16, 128
LOSS_RTOL = GRAD_RTOL = 1e-5
MAX_PARAMS = 20_000_000

# Families that need inputs other than token ids (their causal LM reads audio codebooks or
# images), checked by hand: their text-only call is not what users train.
NEEDS_OTHER_INPUTS = {
    "musicgen": "audio codebooks: input_ids are (rows x codebooks, seq)",
    "musicgen_melody": "audio codebooks: input_ids are (rows x codebooks, seq)",
    "moshi": "audio codebooks beside the text stream",
    "moss_transcribe_diarize": "speech input (audio features)",
    "got_ocr2": "image-conditioned OCR (pixel_values)",
    "git": "image captioning: its loss reads the text after the image tokens (fails without pixel_values)",
    "gemma4_assistant": "speculative-decoding assistant: needs the target model's inputs_embeds and "
                        "shared_kv_states",
    "gemma4_unified_assistant": "speculative-decoding assistant: needs the target model's inputs_embeds and "
                                "shared_kv_states",
    "gemma3n": "multimodal (vision and audio towers; the vision tower needs timm, not installed); gemma3n_text "
               "is the text model",
}

# --- shrinking a config ---------------------------------------------------------------------

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 4, 2, 16
INTER, MOE_INTER, EXPERTS, TOP_K, POSITIONS, WINDOW = 128, 32, 4, 2, 64, 8

LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                "num_decoder_layers", "num_encoder_layers")
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "num_selected_experts",
                "top_k", "moe_top_k")
INTER_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "d_ff",
                "ffn_hidden_size", "d_inner", "dense_intermediate_size", "feed_forward_size")
SIZES = [   # (value, config fields that take it; an int > 0 there is replaced)
    (HIDDEN, ("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "model_dim", "dim", "emb_dim",
              "hidden_size_global")),
    (LAYERS, LAYER_FIELDS),
    (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
             "encoder_attention_heads", "linear_num_heads", "linear_num_value_heads")),
    (KV_HEADS, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                "linear_num_key_heads")),
    (HEAD_DIM, ("head_dim", "d_kv", "attention_head_size", "v_head_dim", "qk_nope_head_dim", "kv_channels",
                "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim", "hidden_size_per_layer_input")),
    (INTER, INTER_FIELDS),
    (MOE_INTER, ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
                 "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")),
    (EXPERTS, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")),
    (TOP_K, TOP_K_FIELDS),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")),
    (WINDOW, ("sliding_window", "attention_window", "window_size", "local_attention_window_len")),
    (32, ("q_lora_rank", "kv_lora_rank")),
    (16, ("state_size", "mamba_d_state", "ssm_state_size", "d_state")),
    (8, ("qk_rope_head_dim", "rotary_dim", "time_step_rank", "mamba_dt_rank", "dt_rank", "chunk_size",
         "mamba_chunk_size", "laurel_rank")),
]
SET_IF_NONE = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS}     # None there breaks some families
ZEROED = ("dropout", "pdrop", "drop_rate", "drop_prob", "layerdrop", "jitter", "drop_path")
FALSE = ("output_router_logits", "use_mamba_kernels", "use_cache")

# Per-family quirks the generic rules cannot know: fields that must agree with the sizes above,
# or defaults that do not build as they are.
QUIRKS = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "mamba2": dict(head_dim=2 * HIDDEN // HEADS, n_groups=1),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  attention_hidden_size=2 * HIDDEN, attention_head_dim=2 * HIDDEN // HEADS, attn_layer_period=1,
                  attn_layer_offset=1),
    "dots1": dict(n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "dots3_note_text": dict(head_dim=HEAD_DIM + 8),     # its sliding layers: nope + rope
    "dbrx": dict(attn_config=dict(rope_theta=1e4, clip_qkv=8.0)),     # its defaults do not run
    "deepseek_v2": dict(num_experts_per_tok=TOP_K),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=8,
                           indexer_compress_ratio=4),
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, intermediate_size=[INTER] * 4,
                         activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
                         layer_types=["sliding_attention", "full_attention"] * 2),
    "dory": dict(num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2,
                 layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]),
    "kolibri1_1": dict(num_hidden_layers=5, layer_types=["sliding_attention"] * 4 + ["indexed_attention"],
                       index_layers=[4], kv_source_layers=[0, 1, 2, 3, 4], mlp_only_layers=[0],
                       mlp_only_intermediate_size=INTER, index_topk=8, index_pool_size=16, index_compression=4,
                       index_num_heads=2, index_num_local_tokens=4, index_num_sink_tokens=1),
    "reformer": dict(attention_head_size=HEAD_DIM, attn_layers=["local", "lsh"], axial_pos_shape=[4, 4],
                     axial_pos_embds_dim=[32, 32], max_position_embeddings=SEQ, local_attn_chunk_length=4,
                     lsh_attn_chunk_length=4, num_buckets=4, hash_seed=0),   # hash_seed: LSH's rotations seeded
}
QUIRKS["qwen4_exp"] = dict(text_config=QUIRKS["qwen4_exp_text"])
QUIRKS["dots3_note"] = dict(text_config=QUIRKS["dots3_note_text"])
# A family again with other settings, where its defaults stop before training (a CaptureError).
VARIANTS = {
    "big_bird+original_full": dict(attention_type="original_full"),   # block_sparse needs longer rows
}
POST_BUILD = {"xmod": lambda m: m.set_default_language("en_XX")}


def _special_ids(d: dict) -> dict:
    """Token ids of the defaults moved into the tiny vocabulary: pad 0, bos 1, eos 2, any other
    (image tokens and the like) 120 and up, where the batch's ids (3..119) never reach."""
    fixed, spare = {}, iter(range(120, VOCAB))
    for key, value in d.items():
        if not (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids")):
            continue
        base = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            if value >= 3 or base is not None and value != base:
                fixed[key] = base if base is not None else next(spare, VOCAB - 1)
        elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            fixed[key] = [2] if key == "eos_token_id" else [next(spare, VOCAB - 1) for _ in value]
    return fixed


def _layer_indices(d: dict, n_default: int) -> list:
    """Which of the default layers the tiny model keeps: at least LAYERS, and the first layer of
    every kind any per-layer list names (a hybrid keeps an attention and a recurrent layer)."""
    keep = set()
    for value in d.values():
        if isinstance(value, list) and len(value) == n_default and n_default > LAYERS:
            seen = set()
            for i, v in enumerate(value):
                key = json.dumps(v, sort_keys=True, default=str)
                if key not in seen:
                    seen.add(key)
                    keep.add(i)
    i = 0
    while len(keep) < LAYERS:
        keep.add(i)
        i += 1
    return sorted(keep)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shrink_fields(layer: dict, kw: dict) -> dict:
    """A per-layer override's sizes shrunk as the config's are (kw: the config's new values)."""
    if not isinstance(layer, dict):
        return layer
    sizes = {name: value for value, names in SIZES for name in names}
    return {k: kw.get(k, sizes.get(k, v)) if _is_int(v) and k not in TOP_K_FIELDS else v for k, v in layer.items()}


def shrink_config(cls, defaults=None, extra=None):
    """cls's config at its defaults, shrunk: (config, the overrides given)."""
    from transformers import CONFIG_MAPPING
    try:
        base = cls(**(defaults or {}))
    except Exception:  # noqa: BLE001 - some defaults fail their own validation: the quirks mend them
        base = cls(**{**(defaults or {}), **{k: v for k, v in (extra or {}).items() if not isinstance(v, dict)}})
    d = base.to_dict()
    kw = {}
    for value, names in SIZES:
        for name in names:
            v = d.get(name)
            if _is_int(v) and v > 0:
                kw[name] = min(v, value) if names is TOP_K_FIELDS else value
    for name, value in SET_IF_NONE.items():
        if name in d and d[name] is None:
            kw[name] = value
    if _is_int(d.get("qk_rope_head_dim")):         # latent attention: head_dim is the rope part
        kw["head_dim"] = kw["qk_rope_head_dim"]
        if "num_key_value_heads" in d:
            kw["num_key_value_heads"] = HEADS        # (a key and value per head)
        if "qk_head_dim" in d:
            kw["qk_head_dim"] = kw["qk_rope_head_dim"] + kw.get("qk_nope_head_dim", HEAD_DIM)
    for key, v in d.items():
        if "vocab" in key and _is_int(v) and v > VOCAB:
            kw[key] = VOCAB
    kw.update(_special_ids(d))
    n_default = next((d[n] for n in LAYER_FIELDS if _is_int(d.get(n))), None)
    if n_default:
        keep = _layer_indices(d, n_default)
        for name in LAYER_FIELDS:
            if _is_int(d.get(name)) and d[name] > 0:
                kw[name] = len(keep)
        for key, value in d.items():
            if isinstance(value, list) and len(value) == n_default and n_default > len(keep):
                kw[key] = [INTER if key in INTER_FIELDS else value[i] for i in keep]
            elif isinstance(value, dict) and value and all(str(k).isdigit() and int(k) < n_default for k in value):
                kw[key] = {keep.index(int(k)): _shrink_fields(v, kw) for k, v in value.items() if int(k) in keep}
    for key, value in d.items():
        low = key.lower()
        if any(z in low for z in ZEROED) and isinstance(value, (int, float)) and not isinstance(value, bool):
            kw[key] = 0.0 if isinstance(value, float) else 0
        if key in FALSE and value:
            kw[key] = False
    for group in ("n_group", "num_expert_group"):
        if _is_int(d.get(group)) and d[group] > 1:
            kw[group], kw["topk_group"] = 2, 1
    for key in ("n_shared_experts", "num_shared_experts"):
        if _is_int(d.get(key)) and d[key] > 1:
            kw[key] = 1
    if "is_decoder" in d:
        kw["is_decoder"] = True
    extra = dict(extra or {})
    for key, sub_cls in getattr(cls, "sub_configs", {}).items():
        sub = d.get(key)
        if isinstance(sub, dict):
            sub_cls = CONFIG_MAPPING[sub["model_type"]] if sub.get("model_type") in CONFIG_MAPPING else sub_cls
            kw[key], _ = shrink_config(sub_cls, {k: v for k, v in sub.items() if k not in ("model_type",
                                                                                             "transformers_version")},
                                       extra.pop(key, None))
    kw.update(extra)
    cfg = cls(**{**(defaults or {}), **kw})
    return cfg, kw


# --- one family (the child) -----------------------------------------------------------------

def make_batch():
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 120, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :10] = -100
    labels[2, 5:] = -100
    labels[3, ::3] = -100
    return {"input_ids": ids, "labels": labels}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    return f"{os.path.relpath(tb[-1].filename, os.path.dirname(HERE)) if tb else '?'}:{tb[-1].lineno if tb else 0}"


def run_family(name: str, lora: int = 0) -> dict:
    import torch
    import transformers
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = name.split("+")[0]     # "type+variant": VARIANTS
    res = {"family": name, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}
    if model_type in NEEDS_OTHER_INPUTS:
        return {**res, "status": "skipped", "why": NEEDS_OTHER_INPUTS[model_type]}
    cls = getattr(transformers, res["class"], None)
    if cls is None:
        return {**res, "status": "skipped", "why": f"transformers has no {res['class']}"}
    required = [n for n, p in inspect.signature(cls.forward).parameters.items()
                if n not in ("self", "input_ids") and p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if required:
        return {**res, "status": "skipped", "why": f"forward requires {required}"}
    t0 = time.perf_counter()
    try:
        cfg, kw = shrink_config(CONFIG_MAPPING[model_type],
                                extra={**QUIRKS.get(model_type, {}), **VARIANTS.get(name, {})})
        with torch.device("meta"):      # a config the rules missed must not fill the shared host
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
        if n > MAX_PARAMS:
            return {**res, "status": "build_fails", "error_type": "SweepConfig",
                    "error": f"shrunk config still has {n:,} parameters", "config": kw}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)    # a composite config gives its text model
        if model_type in POST_BUILD:
            POST_BUILD[model_type](model)
    except Exception as e:  # noqa: BLE001
        return {**res, "status": "build_fails", "error_type": type(e).__name__, "error": _first_line(e),
                "where": _where(e)}
    res["config"] = {k: v for k, v in kw.items() if not hasattr(v, "to_dict")}
    res["params"] = sum(p.numel() for p in model.parameters())
    res["built"] = type(model).__name__
    if lora:
        try:
            model = with_lora(model, lora, model_type)
        except Exception as e:  # noqa: BLE001
            return {**res, "status": "peft_fails", "error_type": type(e).__name__, "error": _first_line(e),
                    "where": _where(e)}
        res["adapter_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    res["attn"] = getattr(cfg, "_attn_implementation", None)
    ref = copy.deepcopy(model)
    batch = make_batch()
    try:
        out = ref(**batch)
        loss_ref = out.loss if hasattr(out, "loss") else out["loss"]
        if loss_ref is None:
            raise RuntimeError("the model returned no loss given labels")
        if not torch.isfinite(loss_ref):
            raise RuntimeError(f"eager loss is {loss_ref.item()}")
        loss_ref.backward()
    except Exception as e:  # noqa: BLE001
        return {**res, "status": "eager_fails", "error_type": type(e).__name__, "error": _first_line(e),
                "where": _where(e)}
    res["eager_s"] = time.perf_counter() - t0
    first = _train_and_compare(model, ref, batch, loss_ref, memory_budget=None)
    res.update(first)
    if first["status"] == "ok" and first["jobs"] == 1:
        # one job: nothing was cut. Again under a budget just above the smallest that fits, which
        # pipelines the model where any cut is legal (tests/parity.py's tight_budget)
        res["tight"] = _tight(model, ref, batch, loss_ref)
        if res["tight"]["status"] in ("mismatch", "rpcompile_error"):
            res["status"] = res["tight"]["status"] + "_tight"
    return res


# Layers "all-linear" takes that eager peft cannot adapt, left out (exclude_modules): a Mamba
# mixer's out_proj and conv1d (peft refuses them: "incompatible with Mamba-based models"), and
# nn.Linear subclasses with forwards of their own: a router returning a tuple (peft's LoRA layer
# reads the result's dtype: an AttributeError), DeepSeek-V4's grouped output projection (the
# adapter's output is not the layer's shape)
_MAMBA_EXCLUDED = {"exclude_modules": ["out_proj", "conv1d"]}
LORA_QUIRKS = {**{name: _MAMBA_EXCLUDED for name in ("mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h")},
               **{name: {"exclude_modules": ["router"]} for name in ("llama4", "llama4_text", "phimoe")},
               "deepseek_v4": {"exclude_modules": ["o_a_proj"]}}


def with_lora(model, rank: int, family: str = ""):
    """`model` as a peft model: LoRA of `rank` on every linear layer but the output layer, the
    adapters random (both factors get a gradient), the base frozen."""
    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                            init_lora_weights=False, **LORA_QUIRKS.get(family, {})))


def _train_and_compare(model, ref, batch, loss_ref, memory_budget) -> dict:
    """One train_step of `model` (its .grad cleared first) against the eager copy `ref`."""
    import rpcompile
    model.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    try:
        cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu", "cpu"], num_microbatches=2,
                                                       memory_budget=memory_budget))
        loss = cm.train_step(**batch)
    except Exception as e:  # noqa: BLE001
        cause = e.__cause__ or e.__context__
        return {"status": "rpcompile_error", "error_type": type(e).__name__, "error": _first_line(e),
                "clear": isinstance(e, rpcompile.RPCompileError), "where": _where(e),
                "cause": f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else None,
                "traceback": traceback.format_exc()[-4000:], "min_budget": getattr(e, "min_budget", None)}
    res = {"rpcompile_s": time.perf_counter() - t1, "jobs": len(cm.plan.stages) if cm.plan is not None else None,
           "loss": float(loss.detach()), "loss_ref": float(loss_ref.detach())}
    loss_err = abs(res["loss"] - res["loss_ref"]) / max(abs(res["loss_ref"]), 1e-12)
    scale = max((q.grad.abs().max().item() for q in ref.parameters() if q.grad is not None and q.grad.numel()),
                default=0.0)
    worst, worst_name, missing = 0.0, None, []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            if p.grad is not None and p.grad.any():
                missing.append(f"{name}: gradient where eager has none")
            continue
        if p.grad is None:
            if q.grad.any():
                missing.append(f"{name}: no gradient where eager has one")
            continue
        err = (p.grad.float() - q.grad.float()).abs().max().item() / max(scale, 1e-30)
        if not math.isfinite(err) or err > worst:
            worst, worst_name = err if math.isfinite(err) else float("inf"), name
    res.update(loss_rel_err=loss_err, grad_rel_err=worst, worst_grad=worst_name, grad_scale=scale,
               grad_problems=missing[:5])
    ok = loss_err <= LOSS_RTOL and worst <= GRAD_RTOL and not missing
    res["status"] = "ok" if ok else "mismatch"
    return res


def _tight(model, ref, batch, loss_ref) -> dict:
    """_train_and_compare under a memory budget 15% above the smallest any plan fits (read off
    the PlanningError of a 1-byte budget)."""
    probe = _train_and_compare(model, ref, batch, loss_ref, memory_budget=1)
    if probe.get("min_budget") is None:
        return {**probe, "status": "no_budget_probe" if probe["status"] == "rpcompile_error" else probe["status"]}
    out = _train_and_compare(model, ref, batch, loss_ref, memory_budget=int(probe["min_budget"] * 1.15))
    out["budget"] = int(probe["min_budget"] * 1.15)
    return out


def child(model_type: str, out_path: str, lora: int = 0) -> int:
    import torch
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        res = run_family(model_type, lora)
    except BaseException as e:  # noqa: BLE001 - reported, not raised
        res = {"family": model_type, "status": "sweep_error", "error_type": type(e).__name__,
               "error": _first_line(e), "traceback": traceback.format_exc()[-4000:]}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


# --- the sweep (the parent) -----------------------------------------------------------------

def run_child(model_type: str, timeout: float, lora: int = 0) -> dict:
    # (a crash's log tail goes to the json)
    work = os.path.join(tempfile.gettempdir(), f"rpcompile_model_sweep{'_lora' if lora else ''}")
    out = os.path.join(work, f"{model_type}.json")
    log = os.path.join(work, f"{model_type}.log")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.makedirs(os.path.dirname(log), exist_ok=True)
    if os.path.exists(out):
        os.remove(out)
    t0 = time.perf_counter()
    with open(log, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.model_sweep", "--child", model_type, out,
                                 "--lora", str(lora)],
                                cwd=os.path.dirname(HERE), stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)     # its own session: the child and its workers
            proc.wait()
            return {"family": model_type, "status": "timeout", "error": f"no result within {timeout:.0f} s",
                    "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    if not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-1500:]
        return {"family": model_type, "status": "crash", "error": f"exit code {rc}", "log_tail": tail,
                "wall_s": wall}
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    res["wall_s"] = wall
    return res


# Vision-language models trained with images: checked by hand (the sweep's text-only call is not
# what users train); results.md's last section, kept by --report.
VLM_SECTION = [
    "## Vision-language models, trained with images",
    "",
    "Not in the sweep above (its families are trained on token ids alone): tiny VLMs from configs, random "
    "weights, 5 rows of 12 tokens with one image a row, its image tokens placed as the processor places them "
    "and labels -100 up to the image's end; `train_step(input_ids=, pixel_values=, labels=, ...)` against eager "
    "(loss, every gradient within 1e-4 of the largest, parameters after SGD-with-momentum steps), transformers "
    "5.25, torch 2.13. Tests: tests/zoo.py (`gemma3_vlm`, `paligemma`), tests/test_vlm.py.",
    "",
    "| family | images | result |",
    "|---|---|---|",
    "| gemma3 (Gemma3ForConditionalGeneration) | SigLIP 16x16 px, 4x4 patches pooled to 4 tokens, "
    "token_type_ids | as eager, 5 rows over 4 microbatches on 3 devices (zoo). Before: InputError, pixel_values' batch "
    "fixed by the f-string of the feature-count check (Note [sizes in messages], rpcompile/capture.py) |",
    "| paligemma | SigLIP 8x8 px, 4 tokens first, prefix-LM token_type_ids | as eager, 5 rows over 3 microbatches "
    "on 2 devices (zoo, tight budget; the same fix) |",
    "| llava | CLIP 8x8 px, 4 tokens (CLS dropped) | as eager with num_microbatches=1, pipelined (test_vlm). "
    "Before: CaptureError at transformers' hook-installation lock (its vision tower's hidden states are asked "
    "for inside forward: Note [recorded outputs]). With microbatches: an InputError naming "
    "`image_features = list(image_features)` (modeling_llava.py:164), a Python list of the batch's images "
    "that fixes pixel_values' batch; torch.compile(fullgraph=True) specialises it the same way |",
    "| smolvlm, idefics3 | pixel_values (rows, images, 3, 8, 8), pixel shuffle to 4 tokens | smolvlm as eager "
    "with num_microbatches=1 (test_vlm; before: a TypeError inside the capture on its output of data-dependent "
    "rows). Microbatches: InputError naming `image_features.split(num_real_images_per_batch.tolist())` "
    "(idefics3: the same) |",
    "| mistral3 (Pixtral tower) | image_sizes | CaptureError: per-image patch grids from `image_sizes.tolist()` "
    "are data-dependent (Pixtral's sdpa `q_length > 1`; with eager attention, the patch merger's `unfold`); "
    "torch.compile(fullgraph=True) cannot either |",
    "| qwen2_vl (qwen2_5_vl, qwen3_vl share the code, not run) | flattened patches + image_grid_thw, "
    "mm_token_type_ids | CaptureError: the vision attention splits by `cu_seqlens.tolist()` (sdpa/eager; "
    "flash-attention's path needs a GPU) and M-RoPE's get_rope_index loops over rows with `.tolist()`; "
    "torch.compile(fullgraph=True) cannot either. Even captured, pixel_values' rows are patches, not the "
    "batch's rows, and precomputed position_ids are (3, rows, seq): rpcompile splits dim 0 only |",
]


# What the triage found for the families that are not ok (results.md's last column).
NOTES = {
    "big_bird": "BigBird's forward swaps its block-sparse attention for new full-attention modules (nn.Linear "
                "built in forward) when rows are too short for block_sparse; the error names that line and the "
                "ways out (Note [modules built in forward]). big_bird+original_full, or after one eager call, "
                "trains as eager (tests/test_capture.py)",
    "dbrx": "expert loop over data-dependent `expert_hit` (torch.compile fullgraph cannot either)",
    "kolibri1_1": "indexer loops over `.unique().tolist()` (data-dependent; torch.compile fullgraph cannot either)",
    "qwen4_exp": "token selection branches on a data-dependent count (torch.compile fullgraph cannot either)",
    "qwen4_exp_text": "token selection branches on a data-dependent count (torch.compile fullgraph cannot either)",
    "reformer": "np.lcm of chunk lengths makes the padding test a tensor branch (torch.compile fullgraph "
                "cannot either)",
    "dots3_note": "the sweep's shrunk vision/audio sub-configs fail validation; dots3_note_text is its text model",
    "hrm_text": "was a mismatch (grads 3.9e-4 of the largest): torch.no_grad() regions dropped as dead code; "
                "fixed (Note [grad-mode regions])",
    "prophetnet": "was NaN loss: targets filled in place were counted before the fill; fixed (Note [targets "
                  "filled in place])",
    "deepseek_v4": "tight budget: the 1-byte probe's PlanningError raised ZeroDivisionError; fixed (Note "
                   "[lengths a model cannot run at])",
}

# The triage of the LoRA sweep's families that are not ok (results_lora.md's last column): those
# refused as without LoRA, and one eager peft cannot train
LORA_NOTES = {**{name: NOTES[name] for name in ("big_bird", "dbrx", "kolibri1_1", "qwen4_exp", "qwen4_exp_text",
                                                 "dots3_note")},
              "reformer": "eager peft's backward fails, the loss needs no gradient: the reversible layers' "
                          "autograd Function takes the hidden states alone, which the frozen embeddings give "
                          "without one; without LoRA a CaptureError, as torch.compile fullgraph"}

STATUS_ORDER = ["mismatch", "mismatch_tight", "rpcompile_error", "rpcompile_error_tight", "timeout", "crash",
                "sweep_error", "eager_fails", "peft_fails", "build_fails", "skipped", "ok"]


def _cell(text, n=160) -> str:
    text = str(text or "").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= n else text[: n - 1] + "…"


def _results_path(lora: int, ext: str) -> str:
    return os.path.join(OUT_DIR, f"results{'_lora' if lora else ''}.{ext}")


def write_results(results: dict, lora: int = 0) -> None:
    import torch
    import transformers
    rows = sorted(results.values(), key=lambda r: (STATUS_ORDER.index(r["status"]), r["family"]))
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if lora:
        import peft
        versions.update(peft=peft.__version__, lora=lora)
    with open(_results_path(lora, "json"), "w") as f:
        json.dump({**versions,
                   "batch": f"{ROWS} rows x {SEQ} tokens", "config": "devices=['cpu','cpu'], num_microbatches=2",
                   "tolerance": {"loss_rel": LOSS_RTOL, "grad_rel_to_largest": GRAD_RTOL},
                   "results": rows}, f, indent=1, default=str)
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUS_ORDER}
    lora_text = (f" With `--lora {lora}` (peft {versions.get('peft')}): each family a peft model, LoRA of rank {lora} "
                 f"(alpha {2 * lora}) on all its linear layers but the output layer (`target_modules=\"all-linear\"`), "
                 f"the adapters random (`init_lora_weights=False`), the base frozen; the gradients compared are "
                 f"the adapters'." if lora else "")
    title = "# Any-model sweep: transformers causal-LM families against eager" + (f", LoRA r={lora}" if lora else "")
    lines = [title, "",
             f"`python -m benchmarks.model_sweep{f' --lora {lora}' if lora else ''}` (benchmarks/model_sweep.py): "
             f"torch {torch.__version__}, "
             f"transformers {transformers.__version__}; each family's config class at its defaults, shrunk "
             f"(hidden {HIDDEN}, {LAYERS} layers or one of each layer kind, {HEADS} heads, vocab {VOCAB}, "
             f"{EXPERTS} experts, dropout 0), seed 0; one `train_step` on `Config(devices=['cpu','cpu'], "
             f"num_microbatches=2)`, {ROWS} rows x {SEQ} tokens with some labels -100, against eager "
             f"forward + backward. ok: loss within rel {LOSS_RTOL:g}, every gradient within {GRAD_RTOL:g} of "
             f"the largest.{lora_text}", "",
             "Counts: " + ", ".join(f"{s} {n}" for s, n in counts.items() if n) + f" (of {len(rows)})", "",
             "| family | class | status | detail | triage |", "|---|---|---|---|---|"]
    for r in rows:
        s = r["status"]
        if s in ("ok", "mismatch", "mismatch_tight", "rpcompile_error_tight"):
            detail = (f"loss {r['loss']:.6g} vs {r['loss_ref']:.6g} (rel {r['loss_rel_err']:.1e}), grads "
                      f"{r['grad_rel_err']:.1e} of largest (worst {r['worst_grad']}); {r['jobs']} jobs")
            if r.get("grad_problems"):
                detail += "; " + "; ".join(r["grad_problems"])
            t = r.get("tight")
            if t and "loss_rel_err" in t:
                detail += (f"; tight budget: {t['jobs']} jobs, loss rel {t['loss_rel_err']:.1e}, grads "
                           f"{t['grad_rel_err']:.1e} (worst {t['worst_grad']})")
            elif t:
                detail += f"; tight budget: {t['status']}: {t.get('error_type')}: {t.get('error')}"
        elif s == "skipped":
            detail = r["why"]
        elif s in ("timeout", "crash"):
            detail = r["error"]
        else:
            detail = f"{r.get('error_type')}: {r.get('error')}"
            if s == "rpcompile_error" and not r.get("clear"):
                detail = "(not an RPCompileError) " + detail
        lines.append(f"| {r['family']} | {r.get('class', '')} | {s} | {_cell(detail, 300)} | "
                     f"{_cell((LORA_NOTES if lora else NOTES).get(r['family'], ''), 300)} |")
    if not lora:
        lines += ["", *VLM_SECTION]
    with open(_results_path(lora, "md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("TYPE", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--resume", action="store_true", help="skip families already in results.json")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per family")
    ap.add_argument("--report", action="store_true", help="rewrite results.md from results.json, run nothing")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="LoRA of rank R on every family (peft, all-linear); results_lora.json and .md")
    args = ap.parse_args(argv)
    if args.child:
        return child(*args.child, lora=args.lora)
    if args.report:
        with open(_results_path(args.lora, "json")) as f:
            write_results({r["family"]: r for r in json.load(f)["results"]}, args.lora)
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    os.makedirs(OUT_DIR, exist_ok=True)
    path = _results_path(args.lora, "json")
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            results = {r["family"]: r for r in json.load(f)["results"]}
    families = args.only.split(",") if args.only else list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) + list(VARIANTS)
    if args.resume:
        families = [f for f in families if f not in results]
    for i, family in enumerate(families):
        res = run_child(family, args.timeout, args.lora)
        results[family] = res
        extra = res.get("error") or res.get("why") or (f"loss rel {res['loss_rel_err']:.1e}, grads "
                                                        f"{res['grad_rel_err']:.1e}, {res['jobs']} jobs"
                                                        if "loss_rel_err" in res else "")
        if "tight" in res:
            t = res["tight"]
            extra += (f"; tight: {t['status']} {t.get('jobs')} jobs " + (f"grads {t['grad_rel_err']:.1e}"
                      if "grad_rel_err" in t else str(t.get("error"))))
        print(f"[{i + 1}/{len(families)}] {family}: {res['status']} ({res.get('wall_s', 0):.0f} s) {_cell(extra, 150)}",
              flush=True)
        write_results(results, args.lora)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)      # rpcompile's worker threads must not keep a child alive
