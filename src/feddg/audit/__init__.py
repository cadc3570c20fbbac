"""Privacy audits: attacks on what each method shares (styles, statistics, prototypes, Grams, weight
updates) and how much of a client's data they rebuild, with and without DP (docs/privacy.md, "Auditing
what leaves a client")."""
