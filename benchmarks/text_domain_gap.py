"""In-domain vs held-out-domain accuracy of a bag-of-words classifier on ``synthetic-sentiment``.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/text_domain_gap.py [--seed 0]``.

For each domain held out: a logistic regression (scikit-learn) on uni- and bigram counts is fit on 80 % of the other
three domains' reviews and scored on their remaining 20 % (in-domain) and on every review of the held-out domain.
Prints a Markdown table (docs/data.md, "Text"): the corpus is meant to put the held-out figure clearly above chance
(50 %) and clearly below the in-domain one.
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import LogisticRegression

from feddg.data.synthetic_text import DOMAINS, generate


def domain_gap(seed: int) -> dict[str, tuple[float, float]]:
    """``{held-out domain: (in-domain accuracy, held-out accuracy)}`` in %."""
    data = generate(seed)
    out = {}
    for target in DOMAINS:
        rng = np.random.default_rng(seed)
        train: list[tuple[str, int]] = []
        holdout: list[tuple[str, int]] = []
        for domain in DOMAINS:
            if domain != target:
                order = rng.permutation(len(data[domain]))
                cut = int(0.8 * len(order))
                train += [data[domain][i] for i in order[:cut]]
                holdout += [data[domain][i] for i in order[cut:]]
        vectorizer = CountVectorizer(ngram_range=(1, 2))
        model = LogisticRegression(max_iter=2000).fit(vectorizer.fit_transform([t for t, _ in train]),
                                                      [k for _, k in train])

        def accuracy(samples: list[tuple[str, int]]) -> float:
            return 100 * float(model.score(vectorizer.transform([t for t, _ in samples]), [k for _, k in samples]))

        out[target] = (accuracy(holdout), accuracy(data[target]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    gap = domain_gap(parser.parse_args().seed)
    means = [float(np.mean([v[i] for v in gap.values()])) for i in (0, 1)]
    print("| held-out domain | " + " | ".join(gap) + " | mean |")
    print("|---" * (len(gap) + 2) + "|")
    for i, row in enumerate(("in-domain held-out 20 %", "held-out domain")):
        print(f"| {row} | " + " | ".join(f"{v[i]:.1f}" for v in gap.values()) + f" | {means[i]:.1f} |")


if __name__ == "__main__":
    main()
