"""Experiment name -> module. Each module defines `add_arguments(parser)` (its own
options) and `run(args) -> dict` (writes OUT/<name>.json, OUT/<name>.md and PNG plots)."""

EXPERIMENTS: dict[str, str] = {
    "copy": "attnkern.experiments.copy_task",
    "relevance": "attnkern.experiments.relevance",
    "ktiw": "attnkern.experiments.ktiw",
    "ibm1": "attnkern.experiments.ibm1",
    "multihead": "attnkern.experiments.multihead",
    # interpretability (Jain & Wallace; Wiegreffe & Pinter; Serrano & Smith)
    "importance": "attnkern.experiments.importance",
    "permutation": "attnkern.experiments.permutation",
    "adversarial": "attnkern.experiments.adversarial",
    "baselines": "attnkern.experiments.baselines",
    "erasure": "attnkern.experiments.erasure",
    "report": "attnkern.experiments.report",
}
