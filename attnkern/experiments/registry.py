"""Experiment name -> module. Each module defines `add_arguments(parser)` (its own
options) and `run(args) -> dict` (writes OUT/<name>.json, OUT/<name>.md and PNG plots)."""

EXPERIMENTS: dict[str, str] = {
    "copy": "attnkern.experiments.dynamics.copy_task",
    "relevance": "attnkern.experiments.dynamics.relevance",
    "ktiw": "attnkern.experiments.dynamics.ktiw",
    "ibm1": "attnkern.experiments.dynamics.ibm1",
    "multihead": "attnkern.experiments.dynamics.multihead",
    # interpretability (Jain & Wallace; Wiegreffe & Pinter; Serrano & Smith)
    "importance": "attnkern.experiments.interpret.importance",
    "permutation": "attnkern.experiments.interpret.permutation",
    "adversarial": "attnkern.experiments.interpret.adversarial",
    "baselines": "attnkern.experiments.interpret.baselines",
    "diagnostic": "attnkern.experiments.interpret.diagnostic",
    "erasure": "attnkern.experiments.interpret.erasure",
    "report": "attnkern.experiments.interpret.report",
}
