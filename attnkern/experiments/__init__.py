"""Attention experiments on the attnkern kernels, in two halves: dynamics/ (how
attention is learned, after Snell et al.) and interpret/ (whether attention
explains a model, after Jain & Wallace, Wiegreffe & Pinter, Serrano & Smith).
Shared by both: the models (models.py), data sources and loaders (data/), the
job runner with its cache (runner.py), helpers (common.py), the registry and
the `attnkern-exp` command line (cli.py). Never imported by `import attnkern`."""
