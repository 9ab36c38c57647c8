"""Write ``assets/embedded/corpus.txt``: the English text the embedded demo model is trained on.

Everything here was written for KV Scope and is placed in the public domain (CC0 1.0), like the
corpus it writes. The corpus has two parts: hand-written paragraphs about the KV cache, attention
(MHA, GQA, MQA, MLA, sliding windows), context length, memory, quantization and flash attention,
and sentences made from templates with real numbers (the byte counts follow the formula in the
README, computed here, so the text is true). The templates draw from ``random.Random(SEED)``: the
same script writes the same bytes every time.

    .venv/bin/python scripts/make_corpus.py        # rewrites assets/embedded/corpus.txt

Changing the corpus changes the embedded model's tokenizer and its trained weights: run
``scripts/train_embedded.py`` afterwards.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "assets" / "embedded" / "corpus.txt"
SEED = 0

HEADER = """\
KV Scope demo corpus. Written for this project by its developers (scripts/make_corpus.py writes
this file) and placed in the public domain (CC0 1.0). It trains the byte-level tokenizer and the
weights of the embedded demo model, so that the model writes plain English about the KV cache.
"""

PARAGRAPHS = """\
Every token keeps a key and a value in every layer, so the cache grows: one more token, one more
key and one more value in each layer. The model never throws them away while the context lasts,
because the next token may need to look back at any of them.

The KV cache is the memory a transformer keeps so that it does not have to read the whole text
again for every new token. When the model writes a word, each layer turns the new token into a
query, a key and a value. The query looks at all the keys that came before, and the values of the
keys it likes best are mixed into the answer. The keys and the values are kept, and that store is
the cache.

Without a cache the model would compute the keys and the values of the whole context again at
every step. With a cache it computes them once and reads them back. The cache trades memory for
time, and for long contexts the memory is the part that hurts.

The size of the cache is easy to work out. Take two, for the key and the value. Multiply by the
number of layers, by the number of key and value heads, by the head dimension, by the number of
tokens, by the batch size, and by the bytes of one element. The answer is the size of the cache in
bytes.

A small model can have a large cache. The weights are paid once, but the cache is paid again for
every token of every sequence in the batch. A long context or a large batch can make the cache
larger than the model itself.

Llama 3 8B has thirty two layers, eight key and value heads and a head dimension of one hundred
and twenty eight. In half precision each token costs one hundred and twenty eight kibibytes of
cache. Four thousand tokens cost half a gigabyte, and one hundred and twenty eight thousand tokens
cost about seventeen gigabytes, which is more than the weights.

Context length is a prepayment of memory. When a server promises a long context, it must keep room
for all the keys and values that context may hold. A static cache takes that room at the first
token; a dynamic cache takes it a little at a time, as the text grows.

A dynamic cache grows with the text. Each new token adds one key and one value to every layer, so
the memory rises in a straight line. The line is steady and easy to predict, and the slope is the
cost of one token.

A static cache is allocated once, for the longest context it will ever hold. Its memory is flat from
the first token to the last. It wastes room when the text is short, but it never asks for more
memory in the middle of a run, and it lets the kernels work on fixed shapes.

Multi head attention gives every query head its own key head and its own value head. It is the
most expressive choice and the most expensive one for the cache: eight query heads mean eight key
heads and eight value heads in every layer.

Grouped query attention lets several query heads share one key head and one value head. With eight
query heads and two key and value heads, four query heads share each pair. The cache shrinks by a
factor of four, and the quality stays close to full multi head attention.

Multi query attention goes all the way: every query head shares a single key head and a single
value head. The cache is as small as it can be with this design, one key and one value per layer
per token. The model can lose a little quality, but it reads far less memory for every token.

When the number of key and value heads goes down, the slope of the memory line goes down with it.
Going from eight heads to two cuts the slope by four. Going from two heads to one cuts it by two
again. The line bends at every switch, and the prediction bends with it.

To turn a multi head model into a grouped query model, the key and value heads of each group can be
averaged into one head. This is the trick the grouped query attention paper uses to start from a
trained model. Going the other way is exact: a head is simply repeated for every query head that
shares it.

Multi head latent attention stores a small latent vector for each token instead of full keys and
values. The keys and the values are rebuilt from the latent when they are needed. The cache holds
the latent and a short rotary key, so it is much smaller than the cache of multi head attention.

Sliding window attention lets each token look back only a fixed number of tokens. Older keys and
values fall out of the window and can be dropped. The cache stops growing when it reaches the size
of the window, and the memory line becomes flat.

Some models mix sliding layers and full layers. The sliding layers keep only the last part of the
text, while the full layers keep everything. The cost of such a model lies between the cost of a
full model and the cost of a model that slides in every layer.

Quantization stores the keys and values with fewer bits. A cache in four bits takes a quarter of
the room of a cache in sixteen bits, plus a little for the scales and the zero points of each
group. A cache in two bits is smaller still, but the values are rougher.

A quantized cache usually keeps the newest tokens in full precision. When enough new tokens have
gathered, they are quantized together and added to the packed store. The memory line rises in
small steps instead of a smooth slope.

Flash attention does not change the size of the cache. It changes how the attention is computed:
the scores are worked out in small tiles that fit in fast memory, and the full matrix of scores is
never written out. This saves memory for activations and time, but the keys and values are the same.

Eager attention writes out the whole matrix of scores, one score for every pair of query and key,
for every head. For a long prompt this matrix can be larger than the cache itself. Flash attention
and fused kernels avoid it, which is why they matter most during the prefill.

The prefill reads the whole prompt at once and fills the cache with its keys and values. After the
prefill the model decodes one token at a time. Each step adds one token to the cache and reads all
the keys and values that are already there.

Decoding is usually limited by memory bandwidth, not by arithmetic. For every new token the model
must read its weights and its whole cache. A smaller cache means fewer bytes to read, and that
means more tokens per second.

The weights of a model are fixed. Their size is the number of parameters times the bytes of one
parameter. A model with eight billion parameters in half precision needs sixteen gigabytes for its
weights, before a single token has been read.

Activations are the working memory of one forward pass. They come and go with each step. Their peak
depends on the length of the input, the width of the model and the attention kernel, and during a
long prefill the peak can be large.

When the memory runs out, the run stops with an out of memory error. A good forecast can say in
advance at which token this will happen, because the cache grows by the same amount with every
token.

The predicted line and the observed line should lie on top of each other. The prediction comes from
the formula; the observation comes from the tensors the cache really holds. When they agree to the
byte, the formula is right.

Batch size multiplies the cache. Four sequences in a batch need four times the keys and the values
of one sequence. Servers that answer many users at once spend most of their memory on the cache.

The head dimension is the length of each key and each value vector. Most models use sixty four or
one hundred and twenty eight. Doubling the head dimension doubles the cost of every token in the
cache.

Half precision uses two bytes for each number, single precision uses four, and eight bit formats
use one. The same cache in single precision is twice the size of the cache in half precision.

A long conversation keeps every earlier turn in the cache. The model can answer a question about
the first message because the keys and values of that message are still there. When the context
is full, something must be dropped, and the model forgets.

Offloading moves the cache of layers that are not working to the host memory and brings it back
when it is needed. The GPU holds less, but the copies cost time. It is a way to fit a long context
on a small card.

Paged attention stores the cache in fixed blocks, like pages of memory. A sequence takes new blocks
as it grows, and blocks of finished sequences are given to new ones. Little room is wasted, so a
server can fit more sequences at once.

A rotary embedding turns each query and key by an angle that depends on its position. The model
learns to read the distance between two tokens from the difference of their angles. The rotary
tables are small and are not part of the cache.

The memory of a GPU is shared by the weights, the cache, the activations and the runtime. When the
context grows, only the cache keeps growing, so in the end it is the cache that decides how long
the context can be.

To halve the cache you can halve the number of key and value heads, halve the bytes of each
element, halve the number of layers that keep full attention, or halve the context. Each choice has
its own price in quality.

A switch from multi head attention to grouped query attention can happen in the middle of a run.
The keys and values already in the cache are averaged into fewer heads, and the model goes on
writing. From then on each new token costs less memory.

A switch to multi query attention leaves one key and one value head in each layer. The memory line
becomes shallow. The text goes on, a little rougher perhaps, but the story of the memory is clear.

The model writes one token at a time. Each token looks back at the cache, chooses what to say next,
and adds its own key and value for the tokens that will come after it.

An attention head is a small reader. Its query asks a question, the keys say what each earlier
token is about, and the values carry what each token has to say. The answer of the head is a mix of
the values, weighted by how well each key matches the query.

The softmax turns the scores of one query into weights that add up to one. A key with a high score
gets most of the weight, and keys with low scores are nearly ignored. This is how a head chooses
where to look.

Memory bandwidth is the speed at which a GPU can read its own memory. A card that reads two
terabytes per second can read a cache of twenty gigabytes about one hundred times a second. That is
a hard limit on how fast a long context can be decoded.

The cost of attention during the prefill grows with the square of the prompt length, because every
token looks at every token before it. The cost of the cache grows only in a straight line, one
token at a time.

A model card lists the number of layers, the number of heads, the number of key and value heads and
the head dimension. With these four numbers and the context length you can work out the cache
before you download a single weight.

The calculator answers the question before anything is loaded: what will this context cost me? It
reads the configuration of the model, counts the parameters, and adds the cache, the weights and
the activations for every context length you ask for.

A demo on a stage needs a model that is small enough to run anywhere. This model has four layers,
eight query heads, eight key and value heads and a head dimension of thirty two. Each token costs
eight kibibytes of cache in single precision.

Its cache is tiny next to a real model, but it grows by the same rules. Switch it to grouped query
attention and the slope drops; switch it to multi query attention and the slope drops again. The
plots show the same story a large model would tell.
"""

# ------------------------------------------------------------------------------- facts for templates

# name, layers, query heads, key/value heads, head dim (public configs)
MODELS = [
    ("Llama 3 8B", 32, 32, 8, 128),
    ("Llama 3 70B", 80, 64, 8, 128),
    ("Mistral 7B", 32, 32, 8, 128),
    ("Qwen 2.5 7B", 28, 28, 4, 128),
    ("Gemma 3 27B", 62, 32, 16, 128),
    ("SmolLM2 135M", 30, 9, 3, 64),
    ("Llama 2 7B", 32, 32, 32, 128),
    ("the demo model", 4, 8, 8, 32),
]

DTYPES = [("half precision", 2), ("bfloat16", 2), ("single precision", 4), ("eight bits", 1)]
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight",
                9: "nine", 10: "ten", 16: "sixteen", 28: "twenty eight", 30: "thirty", 32: "thirty two",
                62: "sixty two", 64: "sixty four", 80: "eighty", 128: "one hundred and twenty eight"}


def words(n: int) -> str:
    return NUMBER_WORDS.get(n, f"{n:,}")


def size(n_bytes: int) -> str:
    """Bytes in the largest binary unit that keeps a small number, the way people say it."""
    for unit, scale in (("gibibytes", 2**30), ("mebibytes", 2**20), ("kibibytes", 2**10)):
        if n_bytes >= scale:
            value = n_bytes / scale
            text = f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"
            return f"{text} {unit}"
    return f"{n_bytes:,} bytes"


def kv_per_token(layers: int, kv_heads: int, head_dim: int, elem: int) -> int:
    return 2 * layers * kv_heads * head_dim * elem


def template_sentences(rng: random.Random) -> list[str]:
    out: list[str] = []
    for name, layers, q_heads, kv_heads, head_dim in MODELS:
        for dtype, elem in DTYPES:
            per = kv_per_token(layers, kv_heads, head_dim, elem)
            out.append(f"{name} has {words(layers)} layers, {words(kv_heads)} key and value heads and a head "
                       f"dimension of {words(head_dim)}, so in {dtype} every token costs {size(per)} of cache.")
            out.append(f"In {dtype}, one token of {name} keeps {per:,} bytes in the cache: two, for the key and "
                       f"the value, times {words(layers)} layers, times {words(kv_heads)} heads, times "
                       f"{words(head_dim)} numbers, times {words(elem)} bytes.")
            for ctx in rng.sample(CONTEXTS, 3):
                total = per * ctx
                out.append(rng.choice([
                    f"With a context of {ctx:,} tokens in {dtype}, the cache of {name} holds {size(total)}.",
                    f"A context of {ctx:,} tokens costs {name} {size(total)} of cache in {dtype}.",
                    f"If {name} reads {ctx:,} tokens in {dtype}, its keys and values take {size(total)}.",
                    f"At {ctx:,} tokens the cache of {name} in {dtype} has grown to {size(total)}.",
                ]))
        if q_heads > kv_heads:
            out.append(f"{name} uses grouped query attention: {words(q_heads)} query heads share "
                       f"{words(kv_heads)} key and value heads, so each key head serves "
                       f"{words(q_heads // kv_heads)} query heads.")
            out.append(f"With full multi head attention, {name} would keep {words(q_heads)} key heads in every "
                       f"layer, and its cache would be {words(q_heads // kv_heads)} times larger.")
        else:
            out.append(f"{name} uses multi head attention: each of its {words(q_heads)} query heads has its own "
                       "key head and its own value head.")
            for groups in (4, 2, 1):
                if groups < kv_heads:
                    mode = "multi query attention" if groups == 1 else f"grouped query attention with {words(groups)} groups"
                    out.append(f"Switched to {mode}, {name} would keep {words(groups)} key and value "
                               f"{'head' if groups == 1 else 'heads'} per layer, and its cache would shrink by a "
                               f"factor of {words(kv_heads // groups)}.")
    for heads_from, heads_to in ((8, 4), (8, 2), (8, 1), (4, 2), (4, 1), (2, 1), (32, 8), (16, 4)):
        out.append(rng.choice([
            f"Going from {words(heads_from)} key and value heads to {words(heads_to)} cuts the cost of every "
            f"token by a factor of {words(heads_from // heads_to)}.",
            f"When {words(heads_from)} key and value heads become {words(heads_to)}, the cache grows "
            f"{words(heads_from // heads_to)} times more slowly.",
            f"A model that keeps {words(heads_to)} key and value heads instead of {words(heads_from)} needs "
            f"{words(heads_from // heads_to)} times less memory for its cache.",
        ]))
    for window in (512, 1024, 2048, 4096, 8192):
        out.append(rng.choice([
            f"With a sliding window of {window:,} tokens, each layer keeps only the last {window:,} keys and "
            "values, and the cache stops growing there.",
            f"A window of {window:,} tokens caps the cache: after {window:,} tokens the oldest keys and values "
            "are dropped as new ones arrive.",
            f"Once the text is longer than the window of {window:,} tokens, the memory line of a sliding layer "
            "is flat.",
        ]))
    for bits, name in ((8, "eight"), (4, "four"), (2, "two")):
        out.append(f"A cache quantized to {name} bits keeps each key and value in {name} bits instead of "
                   f"sixteen, about {words(16 // bits)} times smaller, plus the scales of each group.")
        out.append(f"In {name} bits the cache is smaller, but every value is rounded to one of "
                   f"{2 ** bits:,} levels, and the model may notice.")
    return out


SUBJECTS = ["The cache", "The KV cache", "The memory", "The key and value cache", "Each layer",
            "The model", "Every token", "The context"]
SIMPLE = [
    ("The cache grows with every token.", "The cache grows by the same amount with every new token."),
    ("Every token keeps a key and a value in every layer.", "Each new token adds a key and a value to every layer."),
    ("The keys and the values stay in memory while the context lasts.",
     "Keys and values are kept until the context ends."),
    ("A longer context needs a larger cache.", "More tokens mean more keys and more values."),
    ("Fewer key and value heads mean a smaller cache.", "With fewer heads, each token costs less memory."),
    ("The weights are paid once; the cache is paid for every token.",
     "The weights do not grow, but the cache does."),
    ("Grouped query attention shares each key head between several query heads.",
     "In grouped query attention, query heads share their keys and values."),
    ("Multi query attention keeps a single key head and a single value head.",
     "With multi query attention there is one key and one value per layer per token."),
    ("A sliding window keeps only the most recent tokens.", "Old tokens leave the window and their keys are dropped."),
    ("Quantization stores the cache with fewer bits.", "A quantized cache packs each value into a few bits."),
    ("Flash attention never writes out the full matrix of scores.",
     "Flash attention works in tiles and saves the memory of the scores."),
    ("Flash attention does not make the cache smaller.", "The cache is the same size with flash attention or without it."),
    ("The prefill fills the cache with the keys and values of the prompt.",
     "After the prefill, the model decodes one token at a time."),
    ("A static cache takes its memory at the first token.", "A dynamic cache takes its memory a little at a time."),
    ("The prediction and the measurement agree to the byte.", "The predicted line lies on the observed line."),
    ("Decoding reads the whole cache for every new token.", "A smaller cache means fewer bytes to read for each token."),
    ("Latent attention stores a small vector per token and rebuilds the keys and values from it.",
     "Multi head latent attention keeps a compressed latent instead of full keys and values."),
    ("The batch size multiplies the cache.", "Two sequences need twice the cache of one."),
    ("When the memory runs out, the run stops.", "An out of memory error ends the run at the token where the memory is full."),
    ("The slope of the memory line is the cost of one token.", "Each token adds the same number of bytes to the cache."),
]
BECAUSE = [
    "because the next token may look back at any earlier token",
    "because attention reads every key that came before",
    "because the model must remember what it has already read",
    "because each layer keeps its own keys and values",
    "because nothing is thrown away while the context lasts",
    "because the keys and values of every earlier token are still needed",
]
SO = [
    "so the memory rises in a straight line",
    "so a long context costs a lot of memory",
    "so the cache can outgrow the weights",
    "so the slope of the memory line is steady",
    "so the cost is easy to predict",
    "so a server must plan its memory for the longest context",
]


def varied_sentences(rng: random.Random, count: int) -> list[str]:
    out: list[str] = []
    for _ in range(count):
        kind = rng.randrange(7)
        if kind in (0, 4, 5):
            out.append(rng.choice(rng.choice(SIMPLE)))
        elif kind in (1, 6):
            subject = rng.choice(["The cache grows", "The memory rises", "Every token adds to the cache",
                                  "The keys and the values are kept", "The cache keeps every token"])
            out.append(f"{subject}, {rng.choice(BECAUSE)}.")
        elif kind == 2:
            lead = rng.choice(["Every token keeps a key and a value in every layer",
                               "Each new token adds a key and a value to every layer",
                               "The cache keeps the keys and the values of every token",
                               "A dynamic cache grows with the text"])
            out.append(f"{lead}, {rng.choice(SO)}.")
        else:
            ctx = rng.choice(CONTEXTS)
            name, layers, _q, kv_heads, head_dim = rng.choice(MODELS)
            dtype, elem = rng.choice(DTYPES)
            per = kv_per_token(layers, kv_heads, head_dim, elem)
            out.append(rng.choice([
                f"Double the context from {ctx:,} to {2 * ctx:,} tokens and the cache of {name} doubles too, "
                f"from {size(per * ctx)} to {size(2 * per * ctx)}.",
                f"For {name} in {dtype}, every thousand tokens add about {size(per * 1000)} to the cache.",
                f"A batch of four sequences of {ctx:,} tokens costs {name} {size(4 * per * ctx)} of cache in {dtype}.",
            ]))
    return out


def paragraphs_of(sentences: list[str], rng: random.Random, lo: int = 3, hi: int = 6) -> list[str]:
    out, i = [], 0
    while i < len(sentences):
        n = rng.randint(lo, hi)
        out.append(" ".join(sentences[i:i + n]))
        i += n
    return out


def wrap(text: str, width: int = 100) -> str:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return "\n".join(lines)


def build() -> str:
    rng = random.Random(SEED)
    hand = [" ".join(p.split()) for p in PARAGRAPHS.split("\n\n") if p.strip()]
    facts = template_sentences(rng)
    rng.shuffle(facts)
    blocks = paragraphs_of(facts, rng) + paragraphs_of(varied_sentences(rng, 1800), rng)
    # The hand-written paragraphs are the best English here: they come several times, between the
    # generated ones, so the model learns them as well as it learns the templates.
    for _ in range(6):
        blocks += hand
    rng.shuffle(blocks)
    return HEADER + "\n" + "\n\n".join(wrap(b) for b in blocks) + "\n"


def main() -> int:
    text = build()
    OUT.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(text.encode('utf-8')):,} bytes, {len(text.split()):,} words")
    return 0


if __name__ == "__main__":
    sys.exit(main())
