#!/usr/bin/env python3
"""Export autopar's model zoo: tiny random-initialised models of today's architectures.

Every model is built from a config (no hub access, fixed seed), wrapped so that its forward takes
plain tensors and returns the one or two outputs we train on, exported with torch.onnx.export in
TRAINING mode (dropout 0, so parameters stay untied), and written to tests/data/zoo/<name>/ with its
inputs, PyTorch's outputs, a loss target and PyTorch's losses for 3 SGD steps. See README.md here.
The dropout models (`Spec.dropout`) keep their dropout in the export; their references are the
deterministic part (dropout off) and the statistics of PyTorch's losses with dropout on.

Usage: python scripts/zoo/export.py [--out tests/data/zoo] [--only NAME,...] [--list]
"""

import argparse
import collections
import copy
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from onnx import numpy_helper  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)  # reproducible reductions, and the machine is shared

SEED = 0  # weights: torch.manual_seed(SEED) right before each model is built
DATA_SEED = 1  # inputs and targets: a fresh torch.Generator per model
OPSET = 17
BATCH = 2
SEQ = 16  # text models
VOCAB = 128
PAD = 3  # row 1 of every attention mask ends in PAD padded positions
STEPS = 3
LR = 0.1

# --------------------------------------------------------------------------------------------
# Model specs
# --------------------------------------------------------------------------------------------


class Wrapper(torch.nn.Module):
    """Positional tensors in (in `names` order), the trained output(s) out: plain ONNX I/O."""

    def __init__(self, model, names, fn):
        super().__init__()
        self.m = model
        self.names = list(names)
        self.fn = fn

    def forward(self, *xs):
        return self.fn(self.m, **dict(zip(self.names, xs)))


class Spec:
    """One zoo entry: the wrapped module, its inputs, outputs, loss and provenance."""

    def __init__(self, name, library, cls, model, inputs, outputs, fn, loss, target=None, lr=LR,
                 exporter="torchscript", config=None, notes="", dropout=False):
        self.name = name
        self.library = library
        self.cls = cls
        self.inputs = inputs  # OrderedDict name -> tensor
        self.outputs = outputs  # list of output names
        self.module = Wrapper(model, inputs.keys(), fn)
        self.loss = loss  # (kind, output, other)
        self.target = target  # tensor fed under loss[2] (mse target / ce labels), None for ce-next
        self.lr = lr
        self.exporter = exporter
        self.config = config or {}
        self.notes = notes
        # Exported with its dropout (training mode): see `run` for what is compared.
        self.dropout = dropout
        self.padding_idx_cleared = clear_padding_idx(self.module)


def clear_padding_idx(module):
    """Drop nn.Embedding's padding_idx (the init already zeroed that row).

    PyTorch never updates the padding row (its gradient is masked in the backward), which the ONNX
    Gather cannot express: the exported graph gives that row a gradient wherever the loss sees a
    padded position (ce-next, MSE over all positions, MLM). Cleared, training the module is
    training the graph. Returns the embeddings changed, with their old padding_idx."""
    cleared = {}
    for name, mod in module.named_modules():
        if isinstance(mod, torch.nn.Embedding) and mod.padding_idx is not None:
            cleared[name] = int(mod.padding_idx)
            mod.padding_idx = None
    return cleared


def gen():
    return torch.Generator().manual_seed(DATA_SEED)


def no_dropout(cfg):
    """Every dropout-like probability of a transformers config to 0 (also layerdrop/drop_path)."""
    for k, v in list(vars(cfg).items()):
        if isinstance(v, float) and ("drop" in k or k.endswith("_pdrop")):
            setattr(cfg, k, 0.0)
    for sub in ("text_config", "vision_config", "encoder", "decoder"):
        c = getattr(cfg, sub, None)
        if c is not None and hasattr(c, "to_dict"):
            no_dropout(c)
    return cfg


def dropout_modules(m):
    """(module, p) of every dropout of `m` with a probability above 0."""
    return [(mod, mod.p) for mod in m.modules() if isinstance(mod, torch.nn.Dropout) and mod.p > 0]


def zero_dropout_modules(m):
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout) or type(mod).__name__ in ("Dropout", "DropPath", "StochasticDepth"):
            if hasattr(mod, "p"):
                mod.p = 0.0
            if hasattr(mod, "drop_prob"):
                mod.drop_prob = 0.0


def eager(cfg):
    cfg._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        c = getattr(cfg, sub, None)
        if c is not None:
            c._attn_implementation = "eager"
    return cfg


def hf(cls, cfg):
    torch.manual_seed(SEED)
    cfg = eager(no_dropout(cfg))
    return cls(cfg), cfg


def text_inputs(g, vocab=VOCAB, seq=SEQ, pad_id=0, lo=4, mask=True, type_ids=False):
    """Token ids in [lo, vocab) and an attention mask whose row 1 ends in PAD padded positions."""
    ids = torch.randint(lo, vocab, (BATCH, seq), generator=g)
    am = torch.ones(BATCH, seq, dtype=torch.int64)
    am[1, seq - PAD:] = 0
    ids[1, seq - PAD:] = pad_id
    d = collections.OrderedDict(input_ids=ids)
    if mask:
        d["attention_mask"] = am
    if type_ids:
        tt = torch.zeros(BATCH, seq, dtype=torch.int64)
        tt[:, seq // 2:] = 1
        d["token_type_ids"] = tt
    return d


def cfg_summary(cfg, keys):
    return {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}


DEC_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "sliding_window",
            "partial_rotary_factor", "rotary_pct", "n_embd", "n_layer", "n_head", "n_positions",
            "ffn_dim", "word_embed_proj_dim", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
            "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
            "encoder_ffn_dim", "decoder_ffn_dim", "num_mel_bins", "max_source_positions",
            "max_target_positions", "num_labels", "image_size", "patch_size", "embed_dim", "depths",
            "window_size", "conv_dim", "conv_stride", "conv_kernel", "feat_extract_norm",
            "feed_forward_proj", "relative_attention_num_buckets", "hidden_act", "projection_dim",
            "embedding_size", "num_hidden_groups"]


def causal_lm(name, cls_name, cfg_cls, exporter="torchscript", notes="", **kw):
    import transformers

    cfg = cfg_cls(**kw)
    model, cfg = hf(getattr(transformers, cls_name), cfg)
    inputs = text_inputs(gen(), pad_id=cfg.pad_token_id if isinstance(cfg.pad_token_id, int) else 0)

    def fn(m, input_ids, attention_mask):
        return m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    return Spec(name, "transformers", cls_name, model, inputs, ["logits"], fn,
                ("ce-next", "logits", "input_ids"), exporter=exporter,
                config=cfg_summary(cfg, DEC_KEYS), notes=notes)


def llama(name="llama", exporter="torchscript"):
    from transformers import LlamaConfig

    return causal_lm(name, "LlamaForCausalLM", LlamaConfig, exporter=exporter, vocab_size=VOCAB, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64, pad_token_id=0,
                     notes="grouped-query attention (4 heads, 2 KV heads), RoPE, RMSNorm, SwiGLU")


def mistral():
    from transformers import MistralConfig

    return causal_lm("mistral", "MistralForCausalLM", MistralConfig, vocab_size=VOCAB, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64, sliding_window=8, pad_token_id=0,
                     notes="sliding window 8 < sequence 16, so the window mask is active; GQA 4/2")


def qwen2():
    from transformers import Qwen2Config

    return causal_lm("qwen2", "Qwen2ForCausalLM", Qwen2Config, vocab_size=VOCAB, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=64, pad_token_id=0, notes="q/k/v biases, GQA 4/2")


def phi():
    from transformers import PhiConfig

    return causal_lm("phi", "PhiForCausalLM", PhiConfig, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                     partial_rotary_factor=0.5, pad_token_id=0,
                     notes="parallel attention + MLP, partial rotary (half of each head), gelu_new, LayerNorm")


def gpt_neox():
    from transformers import GPTNeoXConfig

    return causal_lm("gpt-neox", "GPTNeoXForCausalLM", GPTNeoXConfig, vocab_size=VOCAB, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=64, rotary_pct=0.25, pad_token_id=0,
                     notes="fused QKV, parallel residual, partial rotary 0.25")


def gpt2(name="gpt2", exporter="torchscript"):
    from transformers import GPT2Config

    return causal_lm(name, "GPT2LMHeadModel", GPT2Config, exporter=exporter, vocab_size=VOCAB, n_embd=32,
                     n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                     notes="Conv1D layers, tied lm_head (one initializer, two uses)")


def opt():
    from transformers import OPTConfig

    return causal_lm("opt", "OPTForCausalLM", OPTConfig, vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                     word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2, eos_token_id=2,
                     notes="positions from the cumulative sum of the attention mask; tied lm_head")


def gemma():
    from transformers import GemmaConfig

    return causal_lm("gemma", "GemmaForCausalLM", GemmaConfig, vocab_size=VOCAB, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                     head_dim=8, max_position_embeddings=64, pad_token_id=0,
                     notes="multi-query attention (1 KV head), GELU-tanh gated MLP, (1+w) RMSNorm, "
                           "embeddings scaled by sqrt(hidden), tied lm_head")


def seq2seq(name, cls_name, cfg, dec_len=8, dec_start=0, lr=LR, notes=""):
    import transformers

    model, cfg = hf(getattr(transformers, cls_name), cfg)
    g = gen()
    inputs = text_inputs(g, pad_id=cfg.pad_token_id)
    labels = torch.randint(4, VOCAB, (BATCH, dec_len), generator=g)
    dec = torch.cat([torch.full((BATCH, 1), dec_start, dtype=torch.int64), labels[:, :-1]], dim=1)
    inputs["decoder_input_ids"] = dec

    def fn(m, input_ids, attention_mask, decoder_input_ids):
        return m(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                 use_cache=False).logits

    return Spec(name, "transformers", cls_name, model, inputs, ["logits"], fn, ("ce", "logits", "labels"),
                target=labels, lr=lr, config=cfg_summary(cfg, DEC_KEYS),
                notes=notes + "; decoder_input_ids = labels shifted right (teacher forcing)")


def t5():
    from transformers import T5Config

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0,
                   decoder_start_token_id=0)
    return seq2seq("t5", "T5ForConditionalGeneration", cfg, lr=0.01,
                   notes="T5 v1.1 style (gated-gelu, untied lm_head), relative position buckets; lr 0.01 "
                         "(the first loss is 15: T5's init does not scale the unscaled attention)")


def bart():
    from transformers import BartConfig

    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2, forced_eos_token_id=None)
    return seq2seq("bart", "BartForConditionalGeneration", cfg, dec_start=2,
                   notes="tied embeddings (shared by encoder, decoder and lm_head); final_logits_bias is a "
                         "buffer (an initializer that must stay frozen)")


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
                        begin_suppress_tokens=None, apply_spec_augment=False)
    model, cfg = hf(WhisperForConditionalGeneration, cfg)
    g = gen()
    feats = torch.randn(BATCH, 16, 32, generator=g)
    labels = torch.randint(4, VOCAB, (BATCH, 8), generator=g)
    dec = torch.cat([torch.full((BATCH, 1), 1, dtype=torch.int64), labels[:, :-1]], dim=1)
    inputs = collections.OrderedDict(input_features=feats, decoder_input_ids=dec)

    def fn(m, input_features, decoder_input_ids):
        return m(input_features=input_features, decoder_input_ids=decoder_input_ids, use_cache=False).logits

    return Spec("whisper", "transformers", "WhisperForConditionalGeneration", model, inputs, ["logits"], fn,
                ("ce", "logits", "labels"), target=labels, config=cfg_summary(cfg, DEC_KEYS),
                notes="1-D conv front end (k3, strides 1 and 2) on 16 mel bins x 32 frames; the encoder's "
                      "sinusoidal position table is a parameter with requires_grad=False (frozen); "
                      "decoder_input_ids = labels shifted right")


def bert(name="bert", exporter="torchscript"):
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=3)
    model, cfg = hf(BertForSequenceClassification, cfg)
    g = gen()
    inputs = text_inputs(g, type_ids=True)
    labels = torch.randint(0, 3, (BATCH,), generator=g)

    def fn(m, input_ids, attention_mask, token_type_ids):
        return m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits

    return Spec(name, "transformers", "BertForSequenceClassification", model, inputs, ["logits"], fn,
                ("ce", "logits", "labels"), target=labels, exporter=exporter, config=cfg_summary(cfg, DEC_KEYS),
                notes="3 labels (odd), token_type_ids with two segments, pooler + classifier head")


def bert_dropout():
    """BERT with its usual dropout (0.1 on hidden states, attention probabilities and the classifier),
    eager attention so the attention-probability dropout is exported (SDPA's is not)."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=3,
                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    torch.manual_seed(SEED)
    cfg = eager(cfg)
    model = BertForSequenceClassification(cfg)
    g = gen()
    inputs = text_inputs(g, type_ids=True)
    labels = torch.randint(0, 3, (BATCH,), generator=g)

    def fn(m, input_ids, attention_mask, token_type_ids):
        return m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits

    return Spec("bert-dropout", "transformers", "BertForSequenceClassification", model, inputs, ["logits"], fn,
                ("ce", "logits", "labels"), target=labels, config=cfg_summary(cfg, DEC_KEYS + [
                    "hidden_dropout_prob", "attention_probs_dropout_prob"]), dropout=True,
                notes="bert's config with its usual dropout 0.1 (embeddings, attention probabilities, attention "
                      "and FFN outputs, classifier: 8 training-mode Dropout nodes), eager attention")


def roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM

    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=SEQ + 2, pad_token_id=1, type_vocab_size=1)
    model, cfg = hf(RobertaForMaskedLM, cfg)
    g = gen()
    inputs = text_inputs(g, pad_id=1)
    labels = torch.randint(4, VOCAB, (BATCH, SEQ), generator=g)

    def fn(m, input_ids, attention_mask):
        return m(input_ids=input_ids, attention_mask=attention_mask).logits

    return Spec("roberta", "transformers", "RobertaForMaskedLM", model, inputs, ["logits"], fn,
                ("ce", "logits", "labels"), target=labels, config=cfg_summary(cfg, DEC_KEYS),
                notes="positions from the cumulative sum of input_ids != pad; MLM head tied to the word "
                      "embeddings; CE over every position")


def distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    cfg = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                           max_position_embeddings=64)
    model, cfg = hf(DistilBertModel, cfg)
    g = gen()
    inputs = text_inputs(g)
    target = torch.randn(BATCH, SEQ, 32, generator=g)

    def fn(m, input_ids, attention_mask):
        return m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return Spec("distilbert", "transformers", "DistilBertModel", model, inputs, ["last_hidden_state"], fn,
                ("mse", "last_hidden_state", "target"), target=target,
                config={"vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64},
                notes="MSE over every position, padded ones included")


def albert():
    from transformers import AlbertConfig, AlbertModel

    cfg = AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    model, cfg = hf(AlbertModel, cfg)
    g = gen()
    inputs = text_inputs(g)
    target = torch.randn(BATCH, SEQ, 32, generator=g)

    def fn(m, input_ids, attention_mask):
        return m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return Spec("albert", "transformers", "AlbertModel", model, inputs, ["last_hidden_state"], fn,
                ("mse", "last_hidden_state", "target"), target=target, config=cfg_summary(cfg, DEC_KEYS),
                notes="one layer's parameters shared by both layers (a real PyTorch tie: one initializer, "
                      "two structurally identical uses); factorised 16-wide embeddings")


def image_inputs(size, g, classes=10):
    x = torch.randn(BATCH, 3, size, size, generator=g)
    labels = torch.randint(0, classes, (BATCH,), generator=g)
    return collections.OrderedDict(pixel_values=x), labels


def hf_image(name, cls_name, cfg, size, exporter="torchscript", notes=""):
    import transformers

    model, cfg = hf(getattr(transformers, cls_name), cfg)
    inputs, labels = image_inputs(size, gen())

    def fn(m, pixel_values):
        return m(pixel_values=pixel_values).logits

    return Spec(name, "transformers", cls_name, model, inputs, ["logits"], fn, ("ce", "logits", "labels"),
                target=labels, exporter=exporter, config=cfg_summary(cfg, DEC_KEYS), notes=notes)


def vit(name="vit", exporter="torchscript"):
    from transformers import ViTConfig

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=96, num_labels=10)
    return hf_image(name, "ViTForImageClassification", cfg, 32, exporter=exporter,
                    notes="3 heads and 17 tokens (16 patches + CLS): odd sizes, like ViT-tiny's 3 heads / 197 tokens")


def swin():
    from transformers import SwinConfig

    cfg = SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 4], window_size=4,
                     mlp_ratio=2.0, num_labels=10)
    return hf_image("swin", "SwinForImageClassification", cfg, 32,
                    notes="16x16 tokens in 4x4 windows (the second block shifted: roll + mask), patch merging, "
                          "then 8x8 tokens; depths (2, 1) because each block exports ~900 nodes")


def timm_model(name, cls, model, size, config, lr=LR, notes=""):
    inputs, labels = image_inputs(size, gen())

    def fn(m, pixel_values):
        return m(pixel_values)

    zero_dropout_modules(model)
    return Spec(name, "timm", cls, model, inputs, ["logits"], fn, ("ce", "logits", "labels"), target=labels,
                lr=lr, config=config, notes=notes)


def deit():
    import timm

    kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=10)
    torch.manual_seed(SEED)
    m = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, **kw)
    return timm_model("deit", "timm.models.deit.VisionTransformerDistilled (deit_tiny_distilled_patch16_224)", m, 32,
                      kw, notes="CLS + distillation tokens (18 tokens), the two heads averaged")


def convnext():
    import timm

    kw = dict(depths=(1, 1, 2, 1), dims=(8, 16, 32, 64), num_classes=10)
    torch.manual_seed(SEED)
    m = timm.create_model("convnext_atto", pretrained=False, **kw)
    return timm_model("convnext", "timm.models.convnext.ConvNeXt (convnext_atto)", m, 64, kw, lr=0.01,
                      notes="64x64 input: the last stage's 2x2 map goes through a 7x7 depthwise conv with "
                            "padding 3; LayerNorm2d, layer scale")


def resnet50():
    from timm.models.resnet import Bottleneck, ResNet

    kw = dict(layers=[3, 4, 6, 3], channels=(4, 8, 16, 32), stem_width=8, num_classes=10)
    torch.manual_seed(SEED)
    m = ResNet(block=Bottleneck, **kw)
    kw["block"] = "Bottleneck"
    return timm_model("resnet50", "timm.models.resnet.ResNet", m, 64, kw, lr=0.01,
                      notes="the ResNet-50 topology (Bottleneck blocks 3-4-6-3, 53 convs) at 1/16 of the widths; "
                            "BatchNorm in training mode (batch statistics); timm's default zero_init_last (each "
                            "block's last BN scale 0) keeps it well-conditioned: without it the float32 losses "
                            "differ from float64 by 1e-2 at batch 2")


def torchvision_model(name, cls, model, size, config, lr=LR, notes=""):
    inputs, labels = image_inputs(size, gen())

    def fn(m, pixel_values):
        return m(pixel_values)

    zero_dropout_modules(model)
    return Spec(name, "torchvision", cls, model, inputs, ["logits"], fn, ("ce", "logits", "labels"),
                target=labels, lr=lr, config=config, notes=notes)


def mobilenetv3():
    import torchvision

    kw = dict(width_mult=0.25, reduced_tail=True, num_classes=10, dropout=0.0)
    torch.manual_seed(SEED)
    m = torchvision.models.mobilenet_v3_small(weights=None, **kw)
    return torchvision_model("mobilenetv3", "torchvision.models.mobilenet_v3_small", m, 64, kw,
                             notes="Hardswish, Hardsigmoid (squeeze-excitation), depthwise convs, BatchNorm "
                                   "in training mode")


def mobilenetv3_dropout():
    import torchvision

    kw = dict(width_mult=0.25, reduced_tail=True, num_classes=10, dropout=0.2)
    torch.manual_seed(SEED)
    m = torchvision.models.mobilenet_v3_small(weights=None, **kw)
    inputs, labels = image_inputs(64, gen())

    def fn(m, pixel_values):
        return m(pixel_values)

    return Spec("mobilenetv3-dropout", "torchvision", "torchvision.models.mobilenet_v3_small", m, inputs, ["logits"],
                fn, ("ce", "logits", "labels"), target=labels, config=kw, dropout=True,
                notes="mobilenetv3 with its classifier's dropout 0.2 (torchvision's default) and BatchNorm in "
                      "training mode (batch statistics)")


def efficientnet():
    import torchvision
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf

    kw = dict(width_mult=0.2, depth_mult=0.25)
    setting, last = _efficientnet_conf("efficientnet_b0", **kw)
    torch.manual_seed(SEED)
    m = EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=10, last_channel=last)
    del torchvision
    kw.update(arch="efficientnet_b0", num_classes=10, stochastic_depth_prob=0.0)
    return torchvision_model("efficientnet", "torchvision.models.efficientnet.EfficientNet", m, 64, kw, lr=0.001,
                             notes="efficientnet_b0 blocks at width 0.2, depth 0.25: SiLU, squeeze-excitation, "
                                   "depthwise convs, BatchNorm in training mode; lr 0.001 because the 2x2 maps of "
                                   "the last stages make batch statistics of 8 values (larger steps amplify "
                                   "rounding: float32 vs float64 losses 1e-5 at lr 0.01)")


def wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    cfg = Wav2Vec2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, feat_extract_norm="group",
                         do_stable_layer_norm=False, apply_spec_augment=False, layerdrop=0.0)
    model, cfg = hf(Wav2Vec2Model, cfg)
    g = gen()
    inputs = collections.OrderedDict(input_values=torch.randn(BATCH, 800, generator=g))
    target = torch.randn(BATCH, 39, 32, generator=g)

    def fn(m, input_values):
        return m(input_values=input_values).last_hidden_state

    return Spec("wav2vec2", "transformers", "Wav2Vec2Model", model, inputs, ["last_hidden_state"], fn,
                ("mse", "last_hidden_state", "target"), target=target, config=cfg_summary(cfg, DEC_KEYS),
                notes="1-D conv feature encoder with GroupNorm (-> InstanceNormalization), weight-normed "
                      "grouped positional conv (k16, 4 groups), 800 samples -> 39 frames")


def clip():
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=SEQ),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4),
        projection_dim=16)
    model, cfg = hf(CLIPModel, cfg)
    g = gen()
    inputs = text_inputs(g, vocab=VOCAB - 1, pad_id=0)
    # The pooled text token is the highest id of each row (CLIP's end-of-text token).
    inputs["input_ids"][0, SEQ - 1] = VOCAB - 1
    inputs["input_ids"][1, SEQ - PAD - 1] = VOCAB - 1
    inputs["pixel_values"] = torch.randn(BATCH, 3, 32, 32, generator=g)
    labels = torch.arange(BATCH)

    def fn(m, input_ids, attention_mask, pixel_values):
        return m(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits_per_image

    return Spec("clip", "transformers", "CLIPModel", model, inputs, ["logits_per_image"], fn,
                ("ce", "logits_per_image", "labels"), target=labels, lr=1e-4,
                config={"text": cfg_summary(cfg.text_config, DEC_KEYS),
                        "vision": cfg_summary(cfg.vision_config, DEC_KEYS), "projection_dim": 16},
                notes="image-to-text half of the contrastive loss (labels = [0, 1]); text pooled at the "
                      "argmax of input_ids (cast to int32); logit_scale is a parameter; lr 1e-4 because the 0.02-std "
                      "embeddings get gradients ~30 through the normalised projections")


def unet():
    import diffusers

    kw = dict(sample_size=32, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
              down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
              norm_num_groups=4, attention_head_dim=8)
    torch.manual_seed(SEED)
    m = diffusers.UNet2DModel(**kw)
    g = gen()
    inputs = collections.OrderedDict(sample=torch.randn(BATCH, 3, 32, 32, generator=g),
                                     timestep=torch.tensor([10, 500], dtype=torch.int64))
    target = torch.randn(BATCH, 3, 32, 32, generator=g)

    def fn(m, sample, timestep):
        return m(sample, timestep).sample

    zero_dropout_modules(m)
    return Spec("unet", "diffusers", "UNet2DModel", m, inputs, ["noise_pred"], fn, ("mse", "noise_pred", "target"),
                target=target, config=kw,
                notes="GroupNorm (-> InstanceNormalization), nearest 2x upsampling (Resize), sinusoidal "
                      "timestep embedding, default attention processor (scaled_dot_product_attention)")


class LstmLm(torch.nn.Module):
    """Embedding -> stacked LSTM -> Linear over the vocabulary (a word-level language model)."""

    def __init__(self, vocab, dim, hidden, layers):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.lstm = torch.nn.LSTM(dim, hidden, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids):
        y, _ = self.lstm(self.embed(input_ids))
        return self.head(y)


class BiGruClassifier(torch.nn.Module):
    """Embedding -> bidirectional GRU -> Linear on both directions' last states."""

    def __init__(self, vocab, dim, hidden, classes):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.gru = torch.nn.GRU(dim, hidden, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(2 * hidden, classes)

    def forward(self, input_ids):
        _, h = self.gru(self.embed(input_ids))  # h: [2, batch, hidden], forward then backward
        return self.head(torch.cat([h[0], h[1]], dim=-1))


def lstm_lm():
    kw = dict(vocab_size=VOCAB, embedding_dim=32, hidden_size=32, num_layers=2)
    torch.manual_seed(SEED)
    m = LstmLm(VOCAB, 32, 32, 2)
    inputs = text_inputs(gen(), mask=False)

    def fn(m, input_ids):
        return m(input_ids)

    return Spec("lstm-lm", "torch", "torch.nn.LSTM (scripts/zoo/export.py LstmLm)", m, inputs, ["logits"], fn,
                ("ce-next", "logits", "input_ids"), config=kw,
                notes="Embedding, 2-layer batch-first nn.LSTM (-> two ONNX LSTM nodes, gates reordered by the "
                      "exporter with Slice/Concat on the weights), Linear head; no attention mask (padded "
                      "positions are ordinary tokens)")


def gru_classifier():
    kw = dict(vocab_size=VOCAB, embedding_dim=32, hidden_size=32, bidirectional=True, num_labels=3)
    torch.manual_seed(SEED)
    m = BiGruClassifier(VOCAB, 32, 32, 3)
    g = gen()
    inputs = text_inputs(g, mask=False)
    labels = torch.randint(0, 3, (BATCH,), generator=g)

    def fn(m, input_ids):
        return m(input_ids)

    return Spec("gru-classifier", "torch", "torch.nn.GRU (scripts/zoo/export.py BiGruClassifier)", m, inputs,
                ["logits"], fn, ("ce", "logits", "labels"), target=labels, config=kw,
                notes="Embedding, bidirectional batch-first nn.GRU (-> one ONNX GRU node, direction="
                      "bidirectional, linear_before_reset=1), Linear on the concatenated last states (Y_h), 3 "
                      "labels")


MODELS = collections.OrderedDict([
    # decoders
    ("llama", llama), ("mistral", mistral), ("qwen2", qwen2), ("phi", phi), ("gpt-neox", gpt_neox),
    ("gpt2", gpt2), ("opt", opt), ("gemma", gemma),
    # encoder-decoders
    ("t5", t5), ("bart", bart), ("whisper", whisper),
    # encoders
    ("bert", bert), ("roberta", roberta), ("distilbert", distilbert), ("albert", albert),
    # vision
    ("vit", vit), ("deit", deit), ("swin", swin), ("convnext", convnext), ("mobilenetv3", mobilenetv3),
    ("efficientnet", efficientnet), ("resnet50", resnet50),
    # speech, multimodal, diffusion
    ("wav2vec2", wav2vec2), ("clip", clip), ("unet", unet),
    # the dynamo exporter (torch.export + onnxscript) on the same modules
    ("gpt2-dynamo", lambda: gpt2("gpt2-dynamo", "dynamo")),
    ("llama-dynamo", lambda: llama("llama-dynamo", "dynamo")),
    ("bert-dynamo", lambda: bert("bert-dynamo", "dynamo")),
    ("vit-dynamo", lambda: vit("vit-dynamo", "dynamo")),
    # training-mode exports with dropout
    ("bert-dropout", bert_dropout), ("mobilenetv3-dropout", mobilenetv3_dropout),
    # recurrent networks (torch.nn, exported as ONNX LSTM / GRU)
    ("lstm-lm", lstm_lm), ("gru-classifier", gru_classifier),
])

# PyTorch training runs with dropout on, one per seed, whose losses give the band an autopar run
# with dropout must fall in (see `dropout_band`).
DROPOUT_SEEDS = 16
DROPOUT_SIGMAS = 5

# --------------------------------------------------------------------------------------------
# Loss, training, export, checks
# --------------------------------------------------------------------------------------------

LOSS_TEXT = {
    "mse": "mean over all elements of (OUTPUT - TARGET)^2 (F.mse_loss), padded positions included",
    "ce": "cross-entropy, class dim last, i64 labels of shape OUTPUT.shape[:-1], mean over all labels "
          "(F.cross_entropy(OUTPUT.reshape(-1, C), LABELS.reshape(-1)))",
    "ce-next": "next-token cross-entropy: mean over b < B, t < T-1 of CE(OUTPUT[b, t], INPUT_IDS[b, t+1]), "
               "padded positions included",
}


def loss_fn(spec, out, inputs, target):
    kind, _, other = spec.loss
    if kind == "mse":
        return F.mse_loss(out, target)
    if kind == "ce":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    ids = inputs[other]
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))


def as_tuple(y):
    return y if isinstance(y, tuple) else (y,)


def forward(spec, module):
    return as_tuple(module(*spec.inputs.values()))


def to_f64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def train(spec, module, f64=False):
    """PyTorch's losses: the loss before each of STEPS SGD steps, and after the last one.

    With f64, a float64 copy of the module trains on float64 inputs: how far the float32 losses
    are from it says how well-conditioned the trajectory is (how much rounding it amplifies)."""
    inputs, target = spec.inputs, spec.target
    if f64:
        module = copy.deepcopy(module).double()
        inputs = collections.OrderedDict((k, to_f64(v)) for k, v in inputs.items())
        target = to_f64(target)
    # Some transformers mask builders fill a default-dtype tensor with finfo(float64).min.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if f64 else torch.float32)
    try:
        return sgd(spec, module, inputs, target)
    finally:
        torch.set_default_dtype(default)


def sgd(spec, module, inputs, target):
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=spec.lr)
    losses = []
    for _ in range(STEPS + 1):
        opt.zero_grad(set_to_none=False)
        out = as_tuple(module(*inputs.values()))[spec.outputs.index(spec.loss[1])]
        loss = loss_fn(spec, out, inputs, target)
        losses.append(float(loss))
        if len(losses) <= STEPS:
            loss.backward()
            opt.step()
    return losses


def used_params(spec, module):
    """Names of the parameters the loss depends on (a gradient was produced)."""
    module.zero_grad(set_to_none=True)
    out = forward(spec, module)[spec.outputs.index(spec.loss[1])]
    loss_fn(spec, out, spec.inputs, spec.target).backward()
    used = {n for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return used


def export(spec, path):
    args = tuple(spec.inputs.values())
    names = list(spec.inputs.keys())
    if spec.exporter == "torchscript":
        # do_constant_folding=False keeps initializers = parameters (names, PyTorch layout, ties):
        # folding would store a transposed copy of each Linear weight and split tied embeddings.
        torch.onnx.export(spec.module, args, path, input_names=names, output_names=spec.outputs,
                          opset_version=OPSET, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
        return onnx.load(path)
    with tempfile.TemporaryDirectory() as d:
        tmp = os.path.join(d, "model.onnx")
        torch.onnx.export(spec.module, args, tmp, input_names=names, output_names=spec.outputs,
                          opset_version=OPSET, dynamo=True)
        m = onnx.load(tmp)  # pulls in model.onnx.data: the zoo keeps one self-contained file
    # Each node carries its FX node and Python stack trace (local paths, ~80% of the file): drop them.
    for n in m.graph.node:
        del n.metadata_props[:]
        n.doc_string = ""
    onnx.save(m, path)
    return onnx.load(path)


def check_params(spec, module, model, used):
    """Match every initializer to a parameter or buffer of the module; report the rest."""
    params = dict(module.named_parameters())  # ties appear once
    slots = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers())
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    claimed, rows = set(), {}
    for name, arr in inits.items():
        if name in params:
            ok = np.array_equal(arr, params[name].detach().numpy())
            rows[name] = {"kind": "parameter", "bit_equal": bool(ok),
                          "trainable": bool(params[name].requires_grad)}
            claimed.add(name)
        elif name in buffers:
            b = buffers[name]
            rows[name] = {"kind": "buffer", "bit_equal": bool(np.array_equal(arr, b.detach().numpy()))}
    for name, arr in inits.items():
        if name in rows:
            continue
        hit = None
        for pn, p in params.items():
            if pn in claimed:
                continue
            v = p.detach().numpy()
            if v.shape == arr.shape and np.array_equal(v, arr):
                hit = (pn, "as-is")
            elif v.ndim == 2 and v.T.shape == arr.shape and np.array_equal(v.T, arr):
                hit = (pn, "transposed")
            if hit:
                break
        if hit:
            claimed.add(hit[0])
            rows[name] = {"kind": "parameter", "matches": hit[0], "layout": hit[1], "bit_equal": True,
                          "trainable": bool(params[hit[0]].requires_grad)}
        else:
            rows[name] = {"kind": "other", "dtype": str(arr.dtype), "shape": list(arr.shape)}
    missing_used = sorted(n for n in params if n not in claimed and n in used)
    unused = sorted(n for n in params if n not in claimed and n not in used)
    ties = collections.defaultdict(list)
    for sn, p in slots.items():
        for pn, q in params.items():
            if p is q and sn != pn:
                ties[pn].append(sn)
    float_inits = [n for n, a in inits.items() if a.dtype.kind == "f"]
    freeze = sorted(n for n in float_inits if rows[n]["kind"] != "parameter" or not rows[n].get("trainable", True))
    report = {
        "initializers": len(inits),
        "parameters_in_graph": sum(1 for r in rows.values() if r["kind"] == "parameter"),
        "parameters_unused_by_the_loss": unused,
        "parameters_missing_from_graph": missing_used,
        "buffers": sorted(n for n, r in rows.items() if r["kind"] == "buffer"),
        "other_initializers": {n: r for n, r in rows.items() if r["kind"] == "other"},
        "renamed": {n: r for n, r in rows.items() if "matches" in r},
        "not_bit_equal": sorted(n for n, r in rows.items() if r.get("bit_equal") is False),
        "tied_in_pytorch": {k: v for k, v in ties.items()},
        "freeze": freeze,
        "one_to_one": not missing_used and all(r.get("bit_equal", True) for r in rows.values()),
    }
    return report


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(b).max()
    err = np.abs(a - b).max()
    return float(err / scale) if scale > 0 else float(err)


def inference_copy(path):
    """The model at `path` with every Dropout's training_mode input removed (inference: no drop)."""
    m = onnx.load(path)
    for n in m.graph.node:
        if n.op_type == "Dropout" and len(n.input) > 2:
            del n.input[2:]
    return m.SerializeToString()


def ort_check(path, spec, outs):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    # onnxruntime drops at random in training mode: dropout models are checked without dropping.
    model = inference_copy(path) if spec.dropout else path
    s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    names = {i.name for i in s.get_inputs()}
    feeds = {k: v.numpy() for k, v in spec.inputs.items() if k in names}
    got = s.run(spec.outputs, feeds)
    return {n: rel_err(g, o.detach().numpy()) for n, g, o in zip(spec.outputs, got, outs)}


def dropout_band(spec, module, state, probs):
    """PyTorch's losses with dropout on: DROPOUT_SEEDS runs (torch.manual_seed(s) before each), the
    mean and standard deviation of each step's loss over them."""
    for mod, p in probs:
        mod.p = p
    runs = []
    for s in range(DROPOUT_SEEDS):
        module.load_state_dict(state)
        torch.manual_seed(s)
        runs.append(train(spec, module)[:STEPS])
    module.load_state_dict(state)
    zero_dropout_modules(module)
    a = np.array(runs, np.float64)
    return {
        "ratios": sorted({float(p) for _, p in probs}),
        "modules": len(probs),
        "seeds": DROPOUT_SEEDS,
        "losses_mean": a.mean(0).tolist(),
        "losses_std": a.std(0, ddof=1).tolist(),
        "losses_min": a.min(0).tolist(),
        "losses_max": a.max(0).tolist(),
        "band_sigmas": DROPOUT_SIGMAS,
        "note": f"PyTorch's SGD losses with dropout on, over {DROPOUT_SEEDS} seeds (torch.manual_seed(s), s < "
                f"{DROPOUT_SEEDS}): the masks differ from autopar's (another generator), so `autopar train` with "
                f"dropout is checked to be finite and within losses_mean +- {DROPOUT_SIGMAS} losses_std at every "
                f"step; `losses` are the deterministic part (every dropout 0), which `autopar train --no-dropout` "
                f"and `autopar infer` (which never drops) must equal",
    }


def np_dtype(t):
    return str(t.detach().numpy().dtype)


def value_info(v):
    t = v.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim]
    return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims}


def op_counts(model):
    c = collections.Counter()
    imports = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    for n in model.graph.node:
        dom = n.domain or "ai.onnx"
        c[f"{dom}:{n.op_type}"] += 1
    funcs = [f"{f.domain}:{f.name}" for f in model.functions]
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))), imports, funcs


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def save_npy(path, t):
    # C order: a transposed output (CLIP's logits_per_image) would otherwise be saved Fortran-ordered.
    np.save(path, np.ascontiguousarray(t.detach().numpy() if isinstance(t, torch.Tensor) else t))


def run(spec, outdir):
    d = os.path.join(outdir, spec.name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    module = spec.module.train()
    probs = dropout_modules(module) if spec.dropout else []
    if spec.dropout and not probs:
        raise ValueError(f"{spec.name}: a dropout model without dropout")
    if not spec.dropout:
        zero_dropout_modules(module)
    state = copy.deepcopy(module.state_dict())
    t0 = time.time()
    path = os.path.join(d, "model.onnx")
    model = export(spec, path)
    dt = time.time() - t0
    # Dropout models: exported with their dropout; every reference below but the band is the
    # deterministic part (dropout off).
    zero_dropout_modules(module)
    # Tracing ran the module in training mode: restore BatchNorm's running statistics etc.
    module.load_state_dict(state)
    with torch.no_grad():
        outs = forward(spec, module)
    module.load_state_dict(state)
    used = used_params(spec, module)
    params = check_params(spec, module, model, used)
    errs = ort_check(path, spec, outs)
    module.load_state_dict(state)
    losses = train(spec, module)
    module.load_state_dict(state)
    losses64 = train(spec, module, f64=True)
    module.load_state_dict(state)
    cond = max(abs(a - b) / abs(b) for a, b in zip(losses, losses64))
    band = dropout_band(spec, module, state, probs) if spec.dropout else None

    graph_inputs = [value_info(v) for v in model.graph.input if v.name not in {i.name for i in model.graph.initializer}]
    feeds = {}
    for k, v in spec.inputs.items():
        if k in {g["name"] for g in graph_inputs}:
            save_npy(os.path.join(d, f"{k}.npy"), v)
            feeds[k] = f"{k}.npy"
    for n, o in zip(spec.outputs, outs):
        save_npy(os.path.join(d, f"{n}.npy"), o)
    kind, out, other = spec.loss
    if spec.target is not None:
        save_npy(os.path.join(d, f"{other}.npy"), spec.target)
        feeds[other] = f"{other}.npy"
    loss_spec = f"{kind}:{out}:{other}"
    cmd = ["autopar", "train", f"tests/data/zoo/{spec.name}/model.onnx"]
    for k, f in feeds.items():
        cmd += ["--feed", f"{k}=tests/data/zoo/{spec.name}/{f}"]
    cmd += ["--loss", loss_spec, "--optimizer", "sgd", "--lr", str(spec.lr), "--steps", str(STEPS)]
    for f in params["freeze"]:
        cmd += ["--freeze", f]
    lj = {
        "loss": loss_spec,
        "definition": LOSS_TEXT[kind],
        "optimizer": {"kind": "sgd", "lr": spec.lr, "momentum": 0.0, "weight_decay": 0.0},
        "feeds": feeds,
        "freeze": params["freeze"],
        "losses": losses[:STEPS],
        "losses_note": f"losses[i] = the loss computed in training step i+1 (before its update), as "
                       f"`autopar train --steps {STEPS}` prints them; loss_after_last_step is after the last "
                       f"({STEPS}rd) update",
        "loss_after_last_step": losses[STEPS],
        "losses_f64": losses64[:STEPS],
        "loss_after_last_step_f64": losses64[STEPS],
        "f64_note": "the same training of a float64 copy of the module on float64 inputs (for --precision f64); "
                    "max relative difference of the float32 losses from it: %.1e" % cond,
        "mode": "module in train() mode with every dropout 0 (BatchNorm uses batch statistics)",
        "command": " ".join(cmd),
    }
    if band is not None:
        lj["dropout"] = band
        lj["mode"] = ("the export keeps its training-mode dropout; losses, outputs and losses_f64 are the module "
                      "in train() mode with every dropout 0 (`autopar train --no-dropout`), `dropout` the "
                      "statistics with dropout on")
        lj["command"] = " ".join(cmd + ["--no-dropout"])
    with open(os.path.join(d, "losses.json"), "w") as f:
        json.dump(lj, f, indent=1)
        f.write("\n")

    ops, imports, funcs = op_counts(model)
    files = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))}
    nparams = sum(p.numel() for n, p in spec.module.named_parameters() if n not in params["parameters_unused_by_the_loss"])
    entry = {
        "name": spec.name,
        "library": spec.library,
        "class": spec.cls,
        "config": spec.config,
        "notes": spec.notes,
        "padding_idx_cleared": spec.padding_idx_cleared,
        "exporter": spec.exporter,
        "export": ("torch.onnx.export(opset_version=17, training=TrainingMode.TRAINING, do_constant_folding=False)"
                   if spec.exporter == "torchscript" else
                   "torch.onnx.export(opset_version=17, dynamo=True); external data folded into model.onnx"),
        "opset_import": imports,
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name} {model.producer_version}",
        "inputs": graph_inputs,
        "outputs": [value_info(v) for v in model.graph.output],
        "unused_inputs": [k for k in spec.inputs if k not in feeds],
        "loss": loss_spec,
        "loss_target": ({"name": other, "dtype": np_dtype(spec.target), "shape": list(spec.target.shape)}
                        if spec.target is not None else None),
        "lr": spec.lr,
        "losses": losses[:STEPS],
        "losses_f32_vs_f64": cond,
        "dropout": band,
        "params": nparams,
        "param_check": params,
        "nodes": len(model.graph.node),
        "ops": ops,
        "functions": funcs,
        "ort_max_rel_err": errs,
        "export_seconds": round(dt, 2),
        "files": files,
        "sha256": {"model.onnx": sha256(path)},
    }
    return entry


def versions():
    import diffusers
    import timm
    import torchvision
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "diffusers": diffusers.__version__, "timm": timm.__version__, "torchvision": torchvision.__version__,
            "onnx": onnx.__version__, "onnxruntime": ort.__version__, "numpy": np.__version__}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "zoo"))
    ap.add_argument("--only", default="", help="comma-separated model names (the manifest keeps the others)")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list:
        print("\n".join(MODELS))
        return
    out = os.path.normpath(a.out)
    os.makedirs(out, exist_ok=True)
    mpath = os.path.join(out, "manifest.json")
    old = {}
    if os.path.exists(mpath):
        old = {e["name"]: e for e in json.load(open(mpath))["models"]}
    names = [n for n in a.only.split(",") if n] or list(MODELS)
    for n in names:
        if n not in MODELS:
            sys.exit(f"error: unknown model {n} (see --list)")
    failed = []
    for n in names:
        t0 = time.time()
        try:
            e = run(MODELS[n](), out)
        except Exception as ex:  # keep going: one broken export must not hide the others
            failed.append(n)
            print(f"{n:<14} FAILED: {type(ex).__name__}: {str(ex).splitlines()[0][:200]}", flush=True)
            continue
        old[n] = e
        kb = e["files"]["model.onnx"] / 1024
        print(f"{n:<14} {e['exporter']:<11} params {e['params']:>7}  onnx {kb:7.1f} KiB  nodes {e['nodes']:>5}  "
              f"ort {max(e['ort_max_rel_err'].values()):.1e}  losses {', '.join(f'{x:.6f}' for x in e['losses'])}"
              f"  f64 {e['losses_f32_vs_f64']:.0e}  1:1 {e['param_check']['one_to_one']}  ({time.time() - t0:.1f} s)",
              flush=True)
    order = list(MODELS)
    models = [old[n] for n in order if n in old]
    total = sum(sum(e["files"].values()) for e in models)
    man = {
        "about": "autopar's model zoo: tiny random-initialised exports; made by scripts/zoo/export.py",
        "versions": versions(),
        "seeds": {"weights": f"torch.manual_seed({SEED}) before building each model",
                  "data": f"torch.Generator().manual_seed({DATA_SEED}), fresh per model"},
        "batch": BATCH,
        "steps": STEPS,
        "rel_err": "max|a - b| / max|b| over the tensor (as autopar infer --expect)",
        "total_bytes": total,
        "models": models,
    }
    with open(mpath, "w") as f:
        json.dump(man, f, indent=1)
        f.write("\n")
    print(f"{len(models)} models, {total / 2**20:.2f} MiB in {out}")
    if failed:
        sys.exit(f"error: {len(failed)} export(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
