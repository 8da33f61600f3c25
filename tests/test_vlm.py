"""Vision-language models trained with images, as users fine-tune them with transformers: the
families that split their images with the rows are in the zoo (tests/zoo.py: gemma3_vlm,
paligemma); here what each fix of the capture needed, on a tiny model of the pattern, and the
families whose code makes a Python list of the batch's images (LLaVA, SmolVLM), which train with
one microbatch and are told where when asked for more."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rpcompile

from parity import TIGHT, train_both
from zoo import BATCH, IMAGE_ID, VLM_SEQ, VOCAB, _seeded, _vlm_text, vlm_batch


def _check(cond, msg):
    """transformers' torch_compilable_check while tracing: the message is built, then unused."""
    torch._check_tensor_all(cond)


class TinyVLM(nn.Module):
    """A vision-language model in small: patch features of each row's image projected and put in
    place of its image tokens (masked_scatter), after a feature-count check whose message formats
    the features' rows, as transformers' VLMs build it; then a text block and the LM loss."""

    def __init__(self, d=16, patches=4):
        super().__init__()
        self.patches = patches
        self.vision = nn.Linear(3 * 8 * 8 // patches, d)
        self.emb = nn.Embedding(VOCAB, d)
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, pixel_values, labels, token_type_ids=None):
        feats = self.vision(pixel_values.reshape(pixel_values.shape[0], self.patches, -1))
        embeds = self.emb(input_ids)
        mask = (input_ids == IMAGE_ID).unsqueeze(-1)
        n_features = feats.shape[0] * feats.shape[1]
        _check(mask.sum() * embeds.shape[-1] == feats.numel(), f"tokens and features differ: features {n_features}")
        h = embeds.masked_scatter(mask, feats)
        h = h + self.block(h)
        logits = self.head(h)[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())


def _scalar_eager(m, b):
    loss = m(**b)
    loss.backward()
    return loss


def test_sizes_in_messages_keep_the_batch_dynamic():
    """The message of the feature-count check formats the image features' rows (pixel_values'
    dim 0 times the patches): dynamo guarded that size to its value at capture, and the split of
    5 rows into 2 microbatches was refused ("the captured graph fixed that size"). Note [sizes in
    messages]: formatted lazily, the batch stays dynamic and the rows split as eager's. And
    masked_scatter is measured (Note [ops that need the python dispatcher]): it warned "could not
    measure" at every capture and was costed as 0."""
    model = _seeded(TinyVLM)()
    batches = [vlm_batch(s, 4, 8) for s in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_both(model, batches, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2, memory_budget=TIGHT),
                   eager_step=_scalar_eager, steps=2)
    assert not [w for w in caught if "could not measure" in str(w.message)], [str(w.message) for w in caught]


def llava():
    """LLaVA: a CLIP tower (8x8 pixels, 4x4 patches, its CLS token dropped: 4 image tokens) whose
    hidden state at vision_feature_layer the model asks for inside its forward."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    return LlavaForConditionalGeneration(LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16),
        text_config=LlamaConfig(**_vlm_text()), image_token_index=IMAGE_ID, vision_feature_layer=-1,
        vision_feature_select_strategy="default"))


def _no_token_types(batch):
    return {k: v for k, v in batch.items() if k != "token_type_ids"}


def test_llava_trains_like_eager_in_one_microbatch():
    """LLaVA asks its vision tower for recorded hidden states inside its forward, which nothing in
    the call shows: the capture stopped at transformers' hook-installation lock (a CaptureError,
    Note [recorded outputs]). Its images are a Python list of the batch's rows
    (`list(image_features)`), so it trains in one microbatch, pipelined over 2 devices."""
    batches = [_no_token_types(vlm_batch(s, 4, 8)) for s in range(2)]
    train_both(_seeded(llava)(), batches, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=1,
                                                           memory_budget=TIGHT), steps=2)


def test_llava_microbatches_name_the_line_that_fixed_the_batch():
    """Asked for microbatches, LLaVA's InputError names the model's line that fixed the batch of
    pixel_values (it said only "the model code specialised it")."""
    model = _seeded(llava)()
    cm = rpcompile.compile(model, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=2))
    with pytest.raises(rpcompile.InputError) as err:
        cm.train_step(**_no_token_types(vlm_batch(0, 4, 8)))
    text = str(err.value)
    assert "'pixel_values' at `image_features = list(image_features)" in text and "modeling_llava.py" in text
    assert "num_microbatches=1" in text


def smolvlm():
    """SmolVLM: a SigLIP-like tower over 2x2 patches of 8x8 pixels, pixel-shuffled (scale 2) to 4
    image tokens; padding images dropped by a mask (a data-dependent number of images)."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
    return SmolVLMForConditionalGeneration(SmolVLMConfig(
        text_config=dict(model_type="llama", **_vlm_text()),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=2),
        scale_factor=2, image_token_id=IMAGE_ID))


def test_smolvlm_trains_like_eager_in_one_microbatch():
    """SmolVLM returns its image features, whose rows the data decides (the real images, picked by
    a mask): the capture's dummy outputs read the size's hint, which an unbacked size has not
    (a TypeError inside dynamo's backend call, a CaptureError). pixel_values are (rows, images,
    3, H, W)."""
    batches = []
    for s in range(2):
        b = _no_token_types(vlm_batch(s, 4, 8))
        b["pixel_values"] = b["pixel_values"][:, None]
        batches.append(b)
    assert batches[0]["input_ids"].shape == (BATCH, VLM_SEQ)
    train_both(_seeded(smolvlm)(), batches, rpcompile.Config(devices=["cpu"] * 2, num_microbatches=1,
                                                             memory_budget=TIGHT), steps=2)
