"""Small real models for the tests: transformers decoders from configs, and plain modules."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def qwen3(tied=True, layers=2, vocab=128, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    return Qwen3ForCausalLM(cfg)


def llama(tied=False, layers=2, vocab=128, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


def checkpointing_on(model):
    """The model's own gradient checkpointing on, by transformers 5.25's name where it has it
    (activation_checkpointing_enable: the old name warns)."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def lm_batch(batch=5, seq=12, vocab=128, seed=1):
    """input_ids and labels with -100s spread unevenly over the rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, : seq - 2] = -100
    if batch > 3:
        labels[3, 1:] = -100
    return {"input_ids": ids, "labels": labels}


class TwoLayers(nn.Module):
    """8 features to 4 through a tanh layer of 16, row by row: the forward the batching and loss
    tests build their cases on (`kind` names the case)."""

    def __init__(self, kind=None):
        super().__init__()
        self.kind, self.a, self.b = kind, nn.Linear(8, 16), nn.Linear(16, 4)

    def hidden(self, x):
        return self.b(torch.tanh(self.a(x)))


class MLP(nn.Module):
    def __init__(self, width=16, depth=4):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


class SharedWeights(nn.Module):
    """One Linear used at the start and again at the end of the network."""

    def __init__(self, width=16):
        super().__init__()
        self.shared = nn.Linear(width, width)
        self.body = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x, y):
        h = torch.tanh(self.shared(x))
        for layer in self.body:
            h = torch.tanh(layer(h))
        return F.mse_loss(self.shared(h), y)


class WithBatchNorm(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.bn1 = nn.BatchNorm1d(width)
        self.mid = nn.Linear(width, width)
        self.bn2 = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = torch.relu(self.bn1(self.inp(x)))
        h = torch.relu(self.bn2(self.mid(h)))
        return self.out(h)


class WithDropout(nn.Module):
    def __init__(self, width=16, p=0.3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8 if i == 0 else width, width) for i in range(4))
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return self.out(x)


class GraphBreak(nn.Module):
    """A data-dependent Python branch in forward: dynamo cannot capture it as one graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum().item() > 0:      # data-dependent Python branch
            h = h * 2
        return h.sum()
