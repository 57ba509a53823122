"""Attention experiments on the attnkern kernels: RNN models, data, one module per
experiment, and the `attnkern-exp` command line (cli.py). Never imported by
`import attnkern`."""
