"""Tiny float64 models shared by the tests (random weights, eval mode)."""
import torch
from torch import nn


def tiny_bert(seed=0, layers=2, hidden=16, heads=4, vocab=40, labels=3):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=2 * hidden,
                                  max_position_embeddings=32, num_labels=labels)
    return transformers.BertForSequenceClassification(cfg).double().eval()


def bert_batch(seed=0, n=6, length=7, vocab=40, labels=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, labels, (n,), generator=g)


def tiny_vit(seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=32, image_size=8, patch_size=4, num_channels=1,
                                 num_labels=3)
    return transformers.ViTForImageClassification(cfg).double().eval()


def tiny_clip(seed=0):
    import open_clip
    torch.manual_seed(seed)
    model = open_clip.model.CLIP(
        embed_dim=8,
        vision_cfg=dict(layers=2, width=16, head_width=4, image_size=8, patch_size=4),
        text_cfg=dict(context_length=6, vocab_size=30, width=16, heads=4, layers=2))
    return model.double().eval()


class ClipImageClassifier(nn.Module):
    """Images → logits through a CLIP image tower (the text tower stays unused)."""

    def __init__(self, clip, classes=3):
        super().__init__()
        self.clip = clip
        self.head = nn.Linear(clip.visual.output_dim, classes).double()

    def forward(self, x):
        f = self.clip.encode_image(x)
        return self.head(f / f.norm(dim=-1, keepdim=True))


class MHAClassifier(nn.Module):
    def __init__(self, dim=12, heads=3, kdim=None, vdim=None, bias=True, classes=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.attn = nn.MultiheadAttention(dim, heads, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
        self.kproj = nn.Linear(dim, kdim or dim)
        self.vproj = nn.Linear(dim, vdim or dim)
        self.head = nn.Linear(dim, classes)
        self.double().eval()

    def forward(self, x):
        out, _ = self.attn(x, self.kproj(x), self.vproj(x), need_weights=False)
        return self.head(torch.tanh(out).mean(1))


def tiny_llama(seed=0, layers=1, hidden=16, heads=2, vocab=40, labels=3):
    """A Llama sequence classifier (rotary query/key pairs: the rotary subgroup, docs/maths.md §12)."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=heads, intermediate_size=hidden, max_position_embeddings=16,
                                   num_labels=labels, pad_token_id=0)
    return transformers.LlamaForSequenceClassification(cfg).double().eval()


def llama_batch(seed=0, n=4, length=6, vocab=40, labels=3):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, vocab, (n, length), generator=g)}, torch.randint(0, labels, (n,), generator=g)
