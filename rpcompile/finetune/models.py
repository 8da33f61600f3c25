"""Which model to fine-tune: the built-in tiny one, a known shape with random weights, or a
local HuggingFace checkpoint directory; and LoRA on top of any of them (through peft)."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from .errors import UsageError
from .tokenizer import ByteTokenizer, load_tokenizer

TINY = "tiny"

# The real config.json numbers of the published checkpoints (their shapes only: the weights
# here are random, built from the config with --seed; nothing is downloaded).
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, max_position_embeddings=40960,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
              hidden_act="silu", attention_bias=False, bos_token_id=151643, eos_token_id=151645)
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
               hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=128000,
               eos_token_id=128001)


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


KNOWN_MODELS: dict[str, dict] = {
    # name          hidden, MLP, layers, heads, KV heads, tied embeddings
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "qwen3-14b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "qwen3-32b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "rope_parameters": _llama3_rope(8.0), "tie_word_embeddings": False},
    "llama-3.2-1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "rope_parameters": _llama3_rope(32.0), "tie_word_embeddings": True},
    # The embedded default: Qwen3-style, small enough to train in a minute on two CPU cores.
    TINY: {"model_type": "qwen3", "vocab_size": ByteTokenizer.vocab_size, "hidden_size": 128,
           "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
           "tie_word_embeddings": True, "bos_token_id": ByteTokenizer.bos_token_id,
           "eos_token_id": ByteTokenizer.eos_token_id, "pad_token_id": ByteTokenizer.pad_token_id},
}

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_model_spec(spec: str) -> str:
    """A known name (case-insensitive) or an existing checkpoint directory; else a UsageError."""
    if spec.lower() in KNOWN_MODELS:
        return spec.lower()
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {spec}: no config.json in that directory")
        return str(path.resolve())
    raise UsageError(f"--model {spec}: not a directory and not a known model "
                     f"(known: {', '.join(KNOWN_MODELS)})")


def is_known_name(spec: str) -> bool:
    return spec in KNOWN_MODELS


def tokenizer_for(spec: str):
    """Known shapes train on the byte tokenizer (their ids fit every vocabulary here)."""
    return ByteTokenizer() if is_known_name(spec) else load_tokenizer(spec)


def build_model(spec: str, seed: int):
    """The model in fp32 on the host (rpcompile keeps the fp32 masters there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if is_known_name(spec):
        kwargs = dict(KNOWN_MODELS[spec])
        config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.name_or_path = f"rpcompile-finetune:{spec}"
        origin = f"random init, seed {seed}"
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"--model {spec}: cannot load it as a causal LM "
                             f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
        origin = "loaded"
    return model, origin


def check_model_tokenizer(model, tokenizer, spec: str, seq_len: int) -> None:
    vocab = model.get_input_embeddings().weight.shape[0]
    if tokenizer.vocab_size > vocab:
        raise UsageError(f"--model {spec}: its tokenizer has {tokenizer.vocab_size} tokens but the "
                         f"model's embedding only {vocab}")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise UsageError(f"--seq-len {seq_len}: longer than the model's max_position_embeddings ({max_pos})")


def expert_parameters(model) -> list:
    """The stacked expert weights of a mixture of experts (3-D parameters of a module named
    `experts`, as transformers 5 keeps them: `experts.gate_up_proj`, `experts.down_proj`), by
    the names peft's target_parameters matches."""
    return sorted({".".join(n.split(".")[-2:]) for n, p in model.named_parameters()
                   if p.dim() == 3 and n.split(".")[-2:-1] == ["experts"]})


def apply_lora(model, rank: int):
    """LoRA (rank r, alpha 2r) on the attention and MLP projections, a mixture of experts' stacked
    expert weights among them (peft's target_parameters: Note [LoRA on parameters]); the base is
    frozen."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in LORA_TARGETS if t in names] or "all-linear"
    extra = {}
    experts = expert_parameters(model)
    if experts and isinstance(targets, list) and "target_parameters" in LoraConfig.__dataclass_fields__:
        extra["target_parameters"] = experts      # (all-linear adds them itself, peft >= 0.21)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets,
                        task_type="CAUSAL_LM", **extra)
    with _quiet_peft():
        return get_peft_model(model, config)  # records model.name_or_path as the adapter's base


def base_in_working_dtype(model, dtype) -> None:
    """LoRA: the frozen base's floating parameters in the devices' working dtype (bf16 on GPUs),
    each then its own working copy (Note [frozen weights in place] in rpcompile/runtime/weights.py):
    2 bytes a base parameter on the host, where the fp32 base held 4 and its bf16 copy 2 more. The
    devices compute on the same bf16 values either way; the adapters stay fp32."""
    if dtype is None:
        return
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def load_lora(base, directory):
    from peft import PeftModel

    with _quiet_peft():
        return PeftModel.from_pretrained(base, str(directory), is_trainable=True)


@contextlib.contextmanager
def _quiet_peft():
    """peft 0.21 calls a transformers method that transformers 5 deprecates: not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def count_params(model) -> tuple[int, int]:
    params = list(model.parameters())  # tied weights once
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
