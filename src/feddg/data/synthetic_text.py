"""``synthetic-sentiment``: an offline stand-in for Amazon Reviews (Blitzer et al., 2007), drawn from a seed.

Four domains named as Amazon's (books, dvd, electronics, kitchen), binary sentiment, :data:`PER_DOMAIN` reviews
each of 20-60 words. Each domain has its own topical nouns and products; a review's sentiment shows through cue
words that are **shared** by every domain ("excellent", "a waste of money") or **specific** to its domain
("gripping" for books, "sturdy" for kitchen), a few cues whose polarity **flips** between domains (Blitzer's
"unpredictable": a good plot, a bad kettle), **negated** cues of the opposite polarity ("the plot was not dull"),
contrastive cues of the opposite polarity, and neutral sentences. A seeded :data:`LABEL_NOISE` of the labels is
flipped after the text is drawn. A model trained on three domains therefore knows the shared cues but not the fourth
domain's own: it beats chance there but falls short of its in-domain accuracy (docs/data.md, "Text").
"""

from __future__ import annotations

import random

NAME = "synthetic-sentiment"
VERSION = "v1"
DOMAINS = ("books", "dvd", "electronics", "kitchen")
CLASSES = ("negative", "positive")
PER_DOMAIN = 2000
LABEL_NOISE = 0.1
WORDS = (20, 60)
SHARED_CUE = 0.3  # the chance that a sentiment sentence uses a shared cue rather than a domain-specific one

SHARED = {
    1: ["great", "excellent", "wonderful", "perfect", "fantastic", "amazing", "superb", "worth every penny"],
    0: ["terrible", "awful", "disappointing", "poor", "horrible", "useless", "a waste of money", "the worst"],
}
SHARED_PHRASES = {
    1: ["i would recommend it to anyone", "i love it", "five stars from me", "very happy with this purchase"],
    0: ["i would not recommend it", "i regret buying it", "one star is too many", "i want my money back"],
}
TOPICS = {
    "books": (["novel", "author", "chapter", "plot", "characters", "story", "prose", "ending", "writer", "dialogue"],
              ["book", "novel", "paperback", "memoir"]),
    "dvd": (["film", "movie", "director", "actors", "scenes", "soundtrack", "cast", "episode", "script", "sequel"],
            ["dvd", "movie", "box set", "film"]),
    "electronics": (["battery", "screen", "charger", "remote", "speaker", "cable", "software", "buttons", "sound",
                     "connection"], ["device", "unit", "player", "headset"]),
    "kitchen": (["pan", "knife", "blade", "lid", "handle", "kettle", "blender", "coating", "toaster", "mixer"],
                ["pan", "knife set", "coffee maker", "blender"]),
}
SPECIFIC = {
    "books": {1: ["gripping", "insightful", "beautifully written", "compelling", "moving", "witty"],
              0: ["tedious", "shallow", "poorly edited", "long winded", "cliched", "preachy"]},
    "dvd": {1: ["hilarious", "stunning", "brilliantly acted", "suspenseful", "memorable", "touching"],
            0: ["cheesy", "poorly acted", "grainy", "forgettable", "overacted", "badly dubbed"]},
    "electronics": {1: ["reliable", "crisp", "responsive", "intuitive", "fast", "well built"],
                    0: ["defective", "flimsy", "glitchy", "dead on arrival", "laggy", "buggy"]},
    "kitchen": {1: ["sturdy", "dishwasher safe", "easy to clean", "durable", "razor sharp", "heavy duty"],
                0: ["rusty", "leaky", "cracked", "wobbly", "sticky", "chipped"]},
}
FLIPPED = {"books": 1, "dvd": 1, "electronics": 0, "kitchen": 0}  # the polarity of these cues in each domain
FLIPPING = ["unpredictable", "surprising", "noisy"]
NEUTRAL = ["i bought this {product} last {when}", "my {who} got the {product} for me", "the {noun} arrived on time",
           "i have had this {product} for a {when}", "i read the reviews of the {product} before buying it",
           "this is my second {product}", "the {noun} is what you would expect", "i used the {noun} every day",
           "i compared the {noun} with the one my {who} owns", "the {product} came in a plain box"]
CUE_SENTENCES = ["the {noun} was {cue}", "i found the {noun} {cue}", "overall this {product} is {cue}",
                 "honestly the {noun} felt {cue}", "{cue} is the word for this {product}"]
NEGATED = ["the {noun} was not {cue}", "i would not call the {noun} {cue}", "this {product} is never {cue}"]
CONTRAST = ["the {noun} was {cue} but that is a detail", "only the {noun} seemed {cue} to me"]
WHEN, WHO = ["week", "month", "year", "summer", "winter"], ["sister", "brother", "wife", "husband", "friend", "son"]


def _cue(rng: random.Random, domain: str, polarity: int) -> str:
    """A cue word of ``polarity`` in ``domain``: shared (:data:`SHARED_CUE`) or the domain's own (flipping included)."""
    if rng.random() < SHARED_CUE:
        return rng.choice(SHARED[polarity])
    own = SPECIFIC[domain][polarity] + (FLIPPING if FLIPPED[domain] == polarity else [])
    return rng.choice(own)


def review(rng: random.Random, domain: str, label: int) -> str:
    """One review of ``domain`` with sentiment ``label`` (1 positive), :data:`WORDS` words long."""
    nouns, products = TOPICS[domain]
    target = rng.randint(*WORDS)
    words: list[str] = []
    while len(words) < target:
        kind = rng.random()
        fill = {"noun": rng.choice(nouns), "product": rng.choice(products), "when": rng.choice(WHEN),
                "who": rng.choice(WHO)}
        if kind < 0.35:
            sentence = rng.choice(CUE_SENTENCES).format(cue=_cue(rng, domain, label), **fill)
        elif kind < 0.45:
            sentence = rng.choice(NEGATED).format(cue=_cue(rng, domain, 1 - label), **fill)
        elif kind < 0.53:
            sentence = rng.choice(CONTRAST).format(cue=_cue(rng, domain, 1 - label), **fill)
        elif kind < 0.60:
            sentence = rng.choice(SHARED_PHRASES[label])
        else:
            sentence = rng.choice(NEUTRAL).format(**fill)
        words += (sentence + " .").split()
    return " ".join(words[: WORDS[1]])


def generate(seed: int, per_domain: int = PER_DOMAIN, noise: float = LABEL_NOISE) -> dict[str, list[tuple[str, int]]]:
    """``(text, label)`` per review of each domain: clean labels alternate (balanced), then a seeded ``noise``
    fraction is flipped (drawn from its own stream, so the texts do not depend on ``noise``)."""
    if not 0 <= noise < 0.5:
        raise ValueError(f"label noise must be in [0, 0.5), got {noise}")
    out = {}
    for domain in DOMAINS:
        texts = random.Random(f"{NAME}/{VERSION}/{seed}/{domain}")
        flips = random.Random(f"{NAME}/{VERSION}/{seed}/{domain}/noise")
        out[domain] = [(review(texts, domain, i % 2), i % 2 ^ (flips.random() < noise)) for i in range(per_domain)]
    return out
