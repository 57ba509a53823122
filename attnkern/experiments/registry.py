"""Experiment name -> module. Each module defines `add_arguments(parser)` (its own
options) and `run(args) -> dict` (writes OUT/<name>.json, OUT/<name>.md and PNG plots)."""

EXPERIMENTS: dict[str, str] = {
    # interpretability (Jain & Wallace; Wiegreffe & Pinter; Serrano & Smith)
    "importance": "attnkern.experiments.importance",
    "permutation": "attnkern.experiments.permutation",
    "adversarial": "attnkern.experiments.adversarial",
    "baselines": "attnkern.experiments.baselines",
    "erasure": "attnkern.experiments.erasure",
    "report": "attnkern.experiments.report",
}
