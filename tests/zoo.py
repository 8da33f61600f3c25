"""The model zoo: tiny models of many families, built from configs (no downloads), each with a
batch maker and the eager step its rpcompile training is compared with.

Every entry is a `Case`: `build()` makes the model (seeded), `batch(seed)` one batch of 5 rows
(uneven over 2, 3 or 4 microbatches), `eager(model, batch, M)` runs eager forward + backward
and returns the loss, `call(cm, batch)` runs rpcompile. Dropout is off (its masks come from
rpcompile's own streams, so they cannot equal eager's); everything else is as the family has it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, SEQ, VOCAB = 5, 8, 64


@dataclass
class Case:
    name: str
    build: Callable
    batch: Callable
    eager: Optional[Callable] = None          # eager(model, batch, M) -> loss (backward done)
    call: Optional[Callable] = None           # call(cm, batch) -> loss
    loss_fn: Optional[Callable] = None        # Config(loss_fn=...)
    tight: bool = False                       # plan under a tight memory budget (too small to pipeline otherwise)


def _hf_eager(model, batch, M):
    loss = model(**batch).loss
    loss.backward()
    return loss


def lm_batch(seed, vocab=VOCAB, seq=SEQ):
    """input_ids and labels, with ignored labels spread unevenly over the rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, seq), generator=g)
    labels = ids.clone()
    labels[0, : seq - 2] = -100
    labels[3, 1:] = -100
    return {"input_ids": ids, "labels": labels}


def mlm_batch(seed, vocab=VOCAB, seq=SEQ):
    """Masked LM: about a third of the positions are predicted, padding at the end of some rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (BATCH, seq), generator=g)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[1, -3:] = 0
    mask[4, -1:] = 0
    picked = (torch.rand(BATCH, seq, generator=g) < 0.35) & mask.bool()
    picked[0, 0] = True
    labels = torch.where(picked, ids, torch.full_like(ids, -100))
    ids = torch.where(picked, torch.zeros_like(ids), ids)         # 0: the [MASK] of this vocabulary
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seq2seq_batch(seed, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(2, vocab, (BATCH, 6), generator=g)
    labels[2, 4:] = -100
    labels[4, 1:] = -100
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def image_batch(seed, size=8, classes=3):
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
            "labels": torch.randint(0, classes, (BATCH,), generator=g)}


def _seeded(fn):
    def build():
        torch.manual_seed(0)
        return fn()
    return build


# --- transformers families ---------------------------------------------------------------------

def gpt2():
    """Tied head, learned positions, biases, Conv1D projections; the loss logs (warning_once)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def mistral():
    """Untied head, GQA, sliding-window attention (window 4 < sequence 8)."""
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, max_position_embeddings=32, sliding_window=4,
                                            tie_word_embeddings=False))


def qwen2():
    """Tied head, GQA, biases on q/k/v."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32, tie_word_embeddings=True))


def gpt_neox():
    """Parallel attention and MLP (one residual), fused qkv with biases, partial rotary."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=32,
                                            use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5}))


def falcon():
    """Parallel attention and MLP, multi-query attention; its rotary code indexes with lists."""
    from transformers import FalconConfig, FalconForCausalLM
    return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0))


def gemma():
    """Tied head, GeGLU MLP, (1 + w) RMSNorm, embeddings scaled by sqrt(hidden)."""
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                                        head_dim=8, max_position_embeddings=32))


def bert():
    """Encoder-only masked LM; its loss is a CrossEntropyLoss() module; padding mask."""
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def t5():
    """Encoder-decoder, relative position buckets, CrossEntropyLoss(ignore_index=-100) module."""
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                               num_decoder_layers=1, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def bart():
    """Encoder-decoder with learned positions, labels shifted into decoder inputs."""
    from transformers import BartConfig, BartForConditionalGeneration
    return BartForConditionalGeneration(BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=4, decoder_attention_heads=4,
                                                   encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                                                   dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                                   pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                                   decoder_start_token_id=2))


def vit():
    """Vision transformer: patch embedding (conv), CLS token, classification loss."""
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               intermediate_size=64, image_size=8, patch_size=4, num_labels=3,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def resnet():
    """CNN with BatchNorm (running statistics are buffers updated once per microbatch)."""
    from transformers import ResNetConfig, ResNetForImageClassification
    return ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                     layer_type="basic", num_labels=3))


def qwen3_moe():
    """Mixture of experts: softmax router, top-2 of 4 experts, grouped matmuls over sorted tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              max_position_embeddings=32))


def qwen2_moe():
    """Mixture of experts with a shared expert behind a sigmoid gate, top-2 of 4 unnormalised."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                              max_position_embeddings=32))


def deepseek_v3():
    """Multi-head latent attention (low-rank q and kv, a rope part and a nope part), a dense first
    layer, then routed experts in groups (top-1 of 2 groups) beside a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5))


def gpt_oss():
    """Mixture of experts with biases and a clamped SwiGLU, attention sinks, a sliding-window layer
    beside a full one (eager attention: the sinks)."""
    from transformers import GptOssConfig, GptOssForCausalLM
    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
    model.config._attn_implementation = "eager"
    return model


def phi3_longrope():
    """Phi-3.5's longrope RoPE: the long factors beyond original_max_position_embeddings (4 here,
    below the batch's 8 positions), its long frequencies cached in a plain attribute at the first
    call (Note [plain tensor attributes kept] in rpcompile/capture.py)."""
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, original_max_position_embeddings=4, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 2.5, 3.0, 4.0]}))


def gemma2():
    """Attention-logit and final-logit softcapping, a sliding-window layer beside a full one, four
    norms a layer (eager attention: sdpa has no softcapping)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, sliding_window=4,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0))
    model.config._attn_implementation = "eager"
    return model


def hrm_text():
    """HRM's hierarchical recurrence: one low-level stack run L_cycles times per high-level cycle,
    the early runs under torch.no_grad() (a 1-step gradient), shared weights; prefix-LM mask."""
    from transformers import HrmTextConfig, HrmTextForCausalLM
    return HrmTextForCausalLM(HrmTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=8,
        num_layers_per_stack=1, H_cycles=2, L_cycles=3, L_bp_cycles=[1], num_hidden_layers=8,
        max_position_embeddings=32))


def ctrl():
    """CTRL: sinusoidal positions in a buffer that forward assigns to itself at the input's
    device and dtype (`self.pos_encoding = self.pos_encoding.to(...)`, refused before: Note
    [no-op reassignments] in rpcompile/capture.py); embeddings scaled by sqrt(d)."""
    from transformers import CTRLConfig, CTRLLMHeadModel
    return CTRLLMHeadModel(CTRLConfig(vocab_size=VOCAB, n_positions=32, n_embd=32, dff=64, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0))


def deepseek_v4():
    """DeepSeek-V4: compressed attention (a heavily compressed layer beside a compressed sparse
    one with its indexer), hash-routed and learned-routed experts, hyper-connections. A size of
    its graph, `L // (L // 4)`, is undefined below 4 tokens (Note [lengths a model cannot run
    at] in rpcompile/passes/longest.py: the tight budget's probe raised ZeroDivisionError)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    return DeepseekV4ForCausalLM(DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, q_lora_rank=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"], sliding_window=4, o_groups=2, o_lora_rank=16, index_n_heads=2,
        index_head_dim=16, index_topk=4, qk_rope_head_dim=8, hc_mult=2))


# --- vision-language models --------------------------------------------------------------------
# Rows as the processor lays them out: text, the image's tokens (one id per image feature, between
# begin/end-of-image ids where the family has them), then the answer; labels -100 up to the
# image's end. One image a row: pixel_values' dim 0 is the batch's (split with the rows).

IMAGE_ID, BOI_ID, EOI_ID, VLM_SEQ = VOCAB - 1, VOCAB - 3, VOCAB - 4, 12


def _vlm_text(**kw):
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=32, **kw)


def vlm_batch(seed, image_tokens, size, begin=None, end=None):
    """input_ids with each row's image tokens after 2 or 3 text tokens, labels -100 up to the
    image's end, pixel_values (rows, 3, size, size) and token_type_ids 1 on the image tokens
    (Gemma 3's processor: bidirectional attention over each image)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB - 8, (BATCH, VLM_SEQ), generator=g)
    labels = ids.clone()
    segment = torch.tensor(([begin] if begin is not None else []) + [IMAGE_ID] * image_tokens
                           + ([end] if end is not None else []))
    for r in range(BATCH):
        at = 2 + r % 2
        ids[r, at:at + len(segment)] = segment
        labels[r, :at + len(segment)] = -100
    return {"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, size, size, generator=g), "labels": labels,
            "token_type_ids": (ids == IMAGE_ID).long()}


def gemma3_vlm():
    """Gemma 3 with images: a SigLIP tower (16x16 pixels, 4x4 patches), its 16 patches pooled to 4
    image tokens, bidirectional attention over each image (token_type_ids), a sliding-window text
    layer. Its feature-count check formats the image features' rows in its message: that fixed
    the batch of pixel_values at capture (Note [sizes in messages] in rpcompile/capture.py)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=_vlm_text(sliding_window=4),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=4),
        mm_tokens_per_image=4, image_token_index=IMAGE_ID, boi_token_index=BOI_ID, eoi_token_index=EOI_ID))


def gemma3_vlm_batch(seed):
    return vlm_batch(seed, 4, 16, BOI_ID, EOI_ID)


def paligemma():
    """PaliGemma: SigLIP tower (8x8 pixels, 4x4 patches: 4 image tokens) projected into Gemma; a
    prefix-LM mask (token_type_ids 0 on the image and prompt, 1 on the answer the loss reads)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration
    return PaliGemmaForConditionalGeneration(PaliGemmaConfig(
        text_config=dict(model_type="gemma", **_vlm_text()),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4, projection_dim=32),
        image_token_index=IMAGE_ID, projection_dim=32))


def paligemma_batch(seed):
    """As PaliGemma's processor lays out a row: the image tokens first, then the prompt, then the
    answer (token_type_ids 1, the labels)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB - 8, (BATCH, VLM_SEQ), generator=g)
    ids[:, :4] = IMAGE_ID
    answer = torch.arange(VLM_SEQ) >= 7 + (torch.arange(BATCH)[:, None] % 2)
    return {"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, 8, 8, generator=g),
            "labels": torch.where(answer, ids, torch.full_like(ids, -100)), "token_type_ids": answer.long()}


def batchnorm_eager(model, batch, M):
    """Eager gradient accumulation over the same microbatches: BatchNorm normalises each
    microbatch by its own statistics, as a pipelined step does."""
    n = batch["labels"].shape[0]
    total = 0.0
    for part in zip(*(torch.tensor_split(v, M) for v in batch.values())):
        mb = dict(zip(batch.keys(), part))
        loss = model(**mb).loss * (mb["labels"].shape[0] / n)
        loss.backward()
        total = total + loss.detach()
    return total


# --- custom modules ------------------------------------------------------------------------------

class TupleOutput(nn.Module):
    """Returns (logits, features); the loss is the user's (Config(loss_fn=...))."""

    def __init__(self, d=16, classes=4):
        super().__init__()
        self.inp = nn.Linear(12, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(3))
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h), h


def tuple_loss(output, target):
    """A custom loss over both outputs: label-smoothed cross-entropy plus a feature penalty."""
    logits, feats = output
    return F.cross_entropy(logits, target, label_smoothing=0.1) + 1e-2 * feats.pow(2).mean()


def tuple_batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(BATCH, 12, generator=g), "target": torch.randint(0, 4, (BATCH,), generator=g)}


def tuple_eager(model, batch, M):
    loss = tuple_loss(model(batch["x"]), batch["target"])
    loss.backward()
    return loss


class SharedDict(nn.Module):
    """Returns a dict with its loss; one embedding matrix is the input table and the output
    projection, and one Linear runs in every block (shared parameters); class-weighted
    cross-entropy from an nn.CrossEntropyLoss module with ignore_index."""

    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.shared = nn.Linear(d, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(3))
        self.loss_fct = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 1.5, vocab), ignore_index=-1)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for norm in self.norms:
            h = h + torch.tanh(self.shared(norm(h)))
        logits = h @ self.emb.weight.t()
        return {"logits": logits, "loss": self.loss_fct(logits.view(-1, logits.shape[-1]), labels.view(-1))}


def shared_batch(seed, vocab=32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, 6), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[1, 2:] = -1
    labels[2, :] = -1
    return {"ids": ids, "labels": labels}


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """The classic mixture-of-experts layer: a loop over experts, each taking the tokens routed
    to it with torch.where (sizes that depend on the data)."""

    def __init__(self, d, h, experts, top_k):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = torch.topk(F.softmax(self.gate(x), dim=-1, dtype=torch.float), self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)


class LoopMoELM(nn.Module):
    """A small MoE language model around LoopMoE, returning its loss (CrossEntropyLoss module
    with label smoothing)."""

    def __init__(self, d=16, vocab=VOCAB, layers=2, experts=4, top_k=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.moes = nn.ModuleList(LoopMoE(d, 2 * d, experts, top_k) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.loss_fct = nn.CrossEntropyLoss(label_smoothing=0.05)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        logits = self.head(h)
        return self.loss_fct(logits.flatten(0, 1), labels.flatten())


class NoGradCycles(nn.Module):
    """A shared block run three times, the first two under torch.no_grad() (HRM's 1-step
    gradient in small), then a block of its own and the loss (Note [grad-mode regions] in
    rpcompile/passes/graph_utils.py)."""

    def __init__(self, d=16, vocab=VOCAB):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.low = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d), nn.LayerNorm(d))
        self.high = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d), nn.LayerNorm(d))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        z = torch.zeros_like(h)
        with torch.no_grad():
            for _ in range(2):
                z = self.low(z + h)
        z = self.low(z + h)
        logits = self.head(self.high(h + z))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class NgramTargets(nn.Module):
    """ProphetNet's n-gram loss in small: two prediction streams, their targets filled in place
    (`new_zeros(...).fill_(-100)`, then `t[i] = labels`), the logits transposed stream-first, a
    log_softmax and a mean nll_loss (Note [targets filled in place] in
    rpcompile/passes/normalize_loss.py)."""

    def __init__(self, d=16, vocab=VOCAB, ngram=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(2))
        self.streams = nn.Linear(d, d * ngram)
        self.head = nn.Linear(d, vocab)
        self.ngram = ngram

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = h + block(h)
        rows, seq, d = h.shape
        logits = self.head(self.streams(h).view(rows, seq, self.ngram, d).transpose(1, 2))
        targets = labels.new_zeros(self.ngram, rows, seq).fill_(-100)
        for i in range(self.ngram):
            targets[i, :, :] = labels
        logits = logits.transpose(0, 1).contiguous()
        lprobs = F.log_softmax(logits.view(-1, logits.size(-1)), dim=-1, dtype=torch.float32)
        return F.nll_loss(lprobs, targets.view(-1), reduction="mean")


def plain_eager(model, batch, M):
    out = model(**batch)
    loss = out if isinstance(out, torch.Tensor) else out["loss"]
    loss.backward()
    return loss


CASES = [
    Case("gpt2", _seeded(gpt2), lm_batch),
    Case("mistral", _seeded(mistral), lm_batch),
    Case("qwen2", _seeded(qwen2), lm_batch),
    Case("gpt_neox", _seeded(gpt_neox), lm_batch),
    Case("falcon", _seeded(falcon), lm_batch),
    Case("gemma", _seeded(gemma), lm_batch),
    Case("bert", _seeded(bert), mlm_batch),
    Case("t5", _seeded(t5), seq2seq_batch),
    Case("bart", _seeded(bart), seq2seq_batch),
    Case("vit", _seeded(vit), image_batch),
    Case("resnet", _seeded(resnet), lambda s: image_batch(s, size=16), eager=batchnorm_eager, tight=True),
    Case("qwen3_moe", _seeded(qwen3_moe), lm_batch),
    Case("qwen2_moe", _seeded(qwen2_moe), lm_batch),
    Case("deepseek_v3", _seeded(deepseek_v3), lm_batch),
    Case("gpt_oss", _seeded(gpt_oss), lm_batch),
    Case("gemma2", _seeded(gemma2), lm_batch),
    Case("phi3_longrope", _seeded(phi3_longrope), lm_batch),
    Case("loop_moe", _seeded(LoopMoELM), lm_batch, eager=plain_eager),
    Case("tuple_output", _seeded(TupleOutput), tuple_batch, eager=tuple_eager, loss_fn=tuple_loss,
         call=lambda cm, b: cm.train_step(b["x"], target=b["target"])),
    Case("shared_dict", _seeded(SharedDict), shared_batch, eager=plain_eager),
    Case("hrm_text", _seeded(hrm_text), lm_batch),
    Case("no_grad_cycles", _seeded(NoGradCycles), lm_batch, eager=plain_eager),
    Case("ngram_targets", _seeded(NgramTargets), lm_batch, eager=plain_eager),
    Case("deepseek_v4", _seeded(deepseek_v4), lm_batch, tight=True),
    Case("ctrl", _seeded(ctrl), lm_batch),
    Case("gemma3_vlm", _seeded(gemma3_vlm), gemma3_vlm_batch),
    Case("paligemma", _seeded(paligemma), paligemma_batch, tight=True),
]
BY_NAME = {c.name: c for c in CASES}
