"""Job functions for the runner tests (a module of its own so worker processes can import it)."""

import torch


def square_job(config, seed):
    if config.get("fail"):
        raise RuntimeError(f"job {config['x']} was told to fail")
    return {"y": config["x"] ** 2, "seed": seed, "threads": torch.get_num_threads(),
            "draw": torch.rand(1).item()}
