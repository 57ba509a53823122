"""What a benchmark result records about the machine and the code that made it.

    python benchmarks/machine.py slug     # the folder name of this CPU's results: results/bench/<slug>

Every committed result file under results/bench/ carries machine_meta(); the
tables generated from it (docs/benchmarks.md) print describe() above them.
"""

from __future__ import annotations

import datetime
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

import attnkern


def cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name, with its family and model numbers (a virtual machine's
    name can be as bare as "AMD EPYC"; family 25 model 17 says Zen 4)."""
    fields = cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def cpu_slug(model: str | None = None) -> str:
    """A folder name for one CPU's results, from its model name and numbers:
    "Intel(R) Xeon(R) Processor (family 6, model 167)" -> "intel-xeon-f6m167"."""
    model = cpu_model() if model is None else model
    numbers = re.search(r"\(family (\d+), model (\d+)\)", model)
    name = re.sub(r"\(family \d+, model \d+\)", "", model)
    name = re.sub(r"\((R|TM|tm|r)\)|\b\d+-core\b|\bprocessor\b|\bcpu\b|@.*", " ", name, flags=re.IGNORECASE)
    words = re.findall(r"[a-z0-9]+", name.lower())
    slug = "-".join(words) or "unknown-cpu"
    return slug + (f"-f{numbers.group(1)}m{numbers.group(2)}" if numbers else "")


# The instruction-set extensions a table names (those the kernels' speed
# turns on), as /proc/cpuinfo spells them.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_bf16", "amx_fp16")


def cpu_flags() -> list[str]:
    """The ISA_FLAGS this CPU has."""
    have = set(cpuinfo_fields().get("flags", "").split())
    return [f for f in ISA_FLAGS if f in have]


def checkout_commit(root: Path) -> str:
    """The commit of the git checkout at root, "+changes" when its tracked files differ, or "unknown"."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "csrc", "attnkern", "benchmarks"],
                               cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def code_commit() -> str:
    """The commit of the attnkern this process imported, the code measured (with
    "+changes" when its tracked files differ from it), or "unknown"; when the
    scripts come from another checkout (run from a worktree, attnkern from an
    installed one), both are named, so a table cannot credit the wrong code."""
    measured = Path(attnkern.__file__).resolve().parent.parent
    script = Path(__file__).resolve().parent.parent
    commit = checkout_commit(measured)
    if script != measured:
        commit += f" (attnkern imported from {measured}; this script from {script} at {checkout_commit(script)})"
    return commit


def machine_meta(script: str) -> dict:
    """The machine, the kernels' instruction-set level and GEMM units, torch, the
    commit, the command line (script with this process's arguments) and the date."""
    return dict(cpu=cpu_model(), isa_flags=cpu_flags(), attnkern_level=attnkern.isa.dispatch(),
                torch=torch.__version__, torch_capability=torch.backends.cpu.get_cpu_capability(),
                threads=torch.get_num_threads(), commit=code_commit(), command=" ".join([script, *sys.argv[1:]]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def describe(meta: dict) -> str:
    """The code and command, the CPU, its instruction sets, attnkern's level and half-type GEMM units, torch's."""
    level = meta["attnkern_level"]
    when = f" on {meta['date']}" if meta.get("date") else ""
    return (f"Code: commit {meta.get('commit', '?')}{when}; command: {meta.get('command', '?')}.\n"
            f"CPU: {meta['cpu']}; instruction sets: {' '.join(meta.get('isa_flags') or ['?'])}; "
            f"attnkern CPU kernels at {level.get('active', '?')} (this CPU runs up to {level.get('machine', '?')}), "
            f"bfloat16 attention GEMMs: {level.get('bf16_gemm_unit', '?')}, "
            f"float16: {level.get('fp16_gemm_unit', '?')}; torch {meta['torch']} "
            f"CPU capability {meta['torch_capability']}.")


if __name__ == "__main__":
    if sys.argv[1:] != ["slug"]:
        sys.exit("usage: python benchmarks/machine.py slug")
    print(cpu_slug())
