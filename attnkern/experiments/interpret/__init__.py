"""The interpretability experiments after Jain & Wallace, Wiegreffe & Pinter and
Serrano & Smith (importance, permutation, adversarial, baselines, erasure, report),
the classifiers they share (classifiers.py), their shared machinery (shared.py) and
their agreement measures (metrics.py)."""
