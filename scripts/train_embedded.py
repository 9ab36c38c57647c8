"""Train the embedded demo model on ``assets/embedded/corpus.txt``; write its weights to the assets.

Once, offline, on the CPU, deterministically: the same seed, corpus, preset and library versions
give the same ``assets/embedded/model.safetensors`` byte for byte (one thread, deterministic
algorithms, a fixed number of steps, every random draw from a seeded generator). The app never
trains: it loads that file (``core/model/embedded.py``), checking its SHA-256.

    .venv/bin/python scripts/train_embedded.py                 # the shipped weights (20-27 minutes here)
    .venv/bin/python scripts/train_embedded.py --steps 20 --out /tmp/w.safetensors   # a quick check

The model is the preset's (``assets/presets/embedded.json``: a 4-layer Llama, 8 query heads and 8
K/V heads, head_dim 32, vocabulary 1,024, tied embeddings) and the tokenizer is the app's own,
trained on the same corpus by ``kvscope.core.model.embedded._train_tokenizer``. After training, set
``kvscope.core.model.embedded.WEIGHTS_SHA256`` to the digest this prints.

Training text: the corpus without its header, each paragraph on one line (the file is wrapped at
100 columns for reading; the model should not learn those line breaks), paragraphs separated by a
blank line. Every sample starts with ``<s>``, as a prompt does, mostly at a paragraph's start. The
app's prompts end in a space (``"... so the cache grows: "``), which a byte-level tokenizer encodes
as a lone space token before a word without its space: some word boundaries in the training text
are encoded that way too, so the model knows how to go on after such a prompt.

The app switches the model live to GQA and MQA by mean-pooling each group of K/V heads
(``kvscope.core.runtimes.transformers.convert.regroup_heads``: consecutive heads averaged, query head i reading K/V head
i // group). Each training step draws one of MHA, GQA:4, GQA:2 and MQA and pools the K and V
projections' outputs the same way (the projections are linear, so this is the pooled model's
forward pass), with the gradient flowing into the full MHA weights: the shipped MHA weights are
trained to keep writing English after a switch, not only before it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvscope.core.model import embedded  # noqa: E402

DEFAULT_OUT = embedded.WEIGHTS_PATH


def training_text() -> str:
    """The corpus body (after the header's blank line), one paragraph per line, blank lines between."""
    text = embedded._read_corpus()
    _header, _, body = text.partition("\n\n")
    paragraphs = [" ".join(p.split()) for p in body.split("\n\n") if p.strip()]
    return "\n\n".join(paragraphs)


def encode_stream(tok, text: str, rng: random.Random, split_p: float) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` and the index where each paragraph starts.

    A word boundary is cut with probability ``split_p``: the text before it is encoded on its own
    (ending in a lone space token) and the next word starts without its space, as after a prompt."""
    ids: list[int] = []
    starts: list[int] = []
    paragraphs = text.split("\n\n")
    for n, para in enumerate(paragraphs):
        starts.append(len(ids))
        piece_start = 0
        pieces = []
        for i, ch in enumerate(para):
            if ch == " " and rng.random() < split_p:
                pieces.append(para[piece_start:i + 1])
                piece_start = i + 1
        pieces.append(para[piece_start:])
        if n + 1 < len(paragraphs):
            pieces[-1] += "\n\n"
        for piece in pieces:
            ids.extend(tok.encode(piece, add_special_tokens=False).ids)
    return ids, starts


#: (K/V heads, share of the training steps): MHA, GQA:4, GQA:2, MQA.
HEAD_MODES = ((8, 0.4), (4, 0.15), (2, 0.2), (1, 0.25))


class KVPooling:
    """Forward hooks on every layer's k_proj and v_proj that mean-pool their heads into ``groups``
    (None: off), as ``kvscope.core.runtimes.transformers.convert`` pools the weights when the app switches to GQA/MQA."""

    def __init__(self, model, heads: int, head_dim: int):
        self.heads, self.head_dim, self.groups = heads, head_dim, None
        for layer in model.model.layers:
            layer.self_attn.k_proj.register_forward_hook(self._hook)
            layer.self_attn.v_proj.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, out):
        if self.groups is None or self.groups == self.heads:
            return out
        *lead, _ = out.shape
        per = self.heads // self.groups
        pooled = out.view(*lead, self.groups, per, self.head_dim).mean(dim=-2, keepdim=True)
        return pooled.expand(*lead, self.groups, per, self.head_dim).reshape(*lead, self.heads * self.head_dim)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=embedded.SEED)
    parser.add_argument("--steps", type=int, default=750)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=384, help="tokens per sample, <s> included")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--split-p", type=float, default=0.12)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(args.seed)
    t0 = time.monotonic()

    preset = embedded._read_preset()
    config = LlamaConfig(**{k: v for k, v in preset.items() if k != "_kvscope"})
    config._attn_implementation = "sdpa"
    tok = embedded._train_tokenizer(config.vocab_size)
    stream, starts = encode_stream(tok, training_text(), rng, args.split_p)
    print(f"corpus: {len(stream):,} tokens, {len(starts):,} paragraphs", flush=True)
    data = torch.tensor(stream, dtype=torch.long)
    body = args.seq - 1
    starts = [s for s in starts if s + body <= len(stream)]

    model = LlamaForCausalLM(config)  # transformers' own init, drawn from the seeded global generator
    model.train()
    pooling = KVPooling(model, config.num_key_value_heads, config.head_dim)
    modes, weights = zip(*HEAD_MODES)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    bos = torch.full((args.batch, 1), config.bos_token_id, dtype=torch.long)
    smooth = None
    for step in range(args.steps):
        # Mostly from a paragraph's start (as a prompt starts); some anywhere, for variety.
        offsets = [rng.choice(starts) if rng.random() < 0.6 else rng.randrange(len(stream) - body)
                   for _ in range(args.batch)]
        x = torch.cat([bos, torch.stack([data[o:o + body] for o in offsets])], dim=1)
        pooling.groups = rng.choices(modes, weights)[0]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        smooth = value if smooth is None else 0.95 * smooth + 0.05 * value
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  kv {pooling.groups}  loss {value:.3f}  smoothed {smooth:.3f}  lr {lr_at(step):.2e}  "
                  f"{time.monotonic() - t0:6.0f} s", flush=True)

    model.eval()
    pooling.groups = None
    tensors = {name: p.detach().to(torch.float16).contiguous()
               for name, p in sorted(model.named_parameters())}  # tied head: stored once, as the app builds it
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # One metadata key only: safetensors writes its metadata map in no fixed order, so a second key
    # (the seed, the corpus hash) made two runs with identical tensors differ in their header bytes.
    save_file(tensors, str(args.out), metadata={"format": "pt"})
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    elapsed = time.monotonic() - t0
    print(json.dumps({"out": str(args.out), "bytes": args.out.stat().st_size, "sha256": digest,
                      "final_loss_smoothed": round(smooth or 0.0, 4), "seconds": round(elapsed, 1)}), flush=True)

    with torch.inference_mode():  # a look at what it writes (top-k 40 at temperature 1, like the app)
        from kvscope.core.model.request import DEFAULT_PROMPT

        ids = torch.tensor([tok.encode(DEFAULT_PROMPT).ids])
        gen = torch.Generator().manual_seed(0)
        for _ in range(120):
            logits = model(input_ids=ids).logits[:, -1, :].float()
            top = torch.topk(logits, 40, dim=-1)
            pick = top.indices.gather(-1, torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen))
            ids = torch.cat([ids, pick], dim=1)
        print(repr(tok.decode(ids[0].tolist(), skip_special_tokens=True)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
