"""The cost of a job before and after a change, measured in pairs: two stacks up at once, the same bursts to each.

    .venv/bin/python -m bench.costpair REV [--rounds 10] [--jobs 400] [--cases text,text-wait,image,chat] [--auth]

A single `bench.cost` run moves by ±20 % from one minute to the next on a shared 2-core virtual machine
(docs/bench/log/2026-12-05-cost-fewer-answers-fewer-wakeups.md), more than most changes it is meant to judge, and
runs alternated one after the other still see different minutes.
Here the commit REV (checked out in a temporary worktree) and this working tree are started side by side with
`stoker up`, as `bench.cost` starts one (the simulated device at 0 ms), and the same closed-loop bursts of
`--jobs` jobs from 8 clients go to each in turn, `--rounds` times per case, which goes first swapped every round:
the host's drift falls on both alike. Each burst's CPU is read from /proc over the stack's process tree, as in
`bench.cost`; the table gives CPU ms per job per process kind over all the bursts, and the thread sleeps per job.
Two stacks up at once cost more per job than one (the other's idle loops, shared caches): compare the two
columns, not these numbers with `bench.cost`'s. Writes bench/results/costpair.json and costpair.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from bench.cost import (
    ROOT,
    Load,
    Send,
    Stack,
    cases_for,
    cpu_by_kind,
    delta,
    sleeps,
    stoker_up,
)

RESULTS = ROOT / "bench" / "results"
#: The process kinds the table names (the rest are in the stack's total).
SHOWN = ("API", "inference worker", "Valkey")
console = Console()


@dataclass
class Tally:
    """What one stack spent over the bursts of one case."""

    cpu_s: dict[str, float] = field(default_factory=dict)
    sleeps: int = 0
    jobs: int = 0

    def add(self, cpu_s: dict[str, float], sleeps: int, jobs: int) -> None:
        for kind, seconds in cpu_s.items():
            self.cpu_s[kind] = self.cpu_s.get(kind, 0.0) + seconds
        self.sleeps += sleeps
        self.jobs += jobs

    def per_job(self) -> dict[str, float]:
        """CPU ms per job per kind, the stack's total as `stack`, and thread sleeps per job as `sleeps`."""
        jobs = max(self.jobs, 1)
        ms = {kind: seconds * 1000 / jobs for kind, seconds in self.cpu_s.items()}
        return {**ms, "stack": sum(ms.values()), "sleeps": self.sleeps / jobs}


def markdown(tallies: dict[str, dict[str, Tally]], before: str) -> str:
    """One row per case: before → after for each shown kind, the stack, and the thread sleeps."""
    head = ["case", *SHOWN, "stack", "thread sleeps per job", "jobs each"]
    lines = [f"CPU ms per job, `{before}` → this tree", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, pair in tallies.items():
        was, now = pair["before"].per_job(), pair["after"].per_job()
        cells = [f"{was.get(kind, 0.0):.2f} → {now.get(kind, 0.0):.2f}" for kind in (*SHOWN, "stack")]
        cells.append(f"{was['sleeps']:.1f} → {now['sleeps']:.1f}")
        cells.append(f"{pair['before'].jobs} / {pair['after'].jobs}")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """The commit `rev` checked out in a temporary worktree of this repository, removed after."""
    scratch = Path(tempfile.mkdtemp(prefix="stoker-costpair-"))
    path = scratch / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


def burst(stack: Stack, send: Send, jobs: int, clients: int) -> tuple[dict[str, float], int, int]:
    """One closed-loop burst: CPU seconds per kind, thread sleeps, and jobs answered."""
    cpu, slept = cpu_by_kind(stack.proc.pid), sleeps(stack.proc.pid)
    load = Load(send, jobs, clients, stack.headers)
    load.run(stack.base)
    return delta(cpu, cpu_by_kind(stack.proc.pid)), sleeps(stack.proc.pid) - slept, load.ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the commit to compare this working tree with")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=400, help="jobs per burst")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--cases", default="text,text-wait,image,chat", help="of text, text-wait, image, image-wait, chat"
    )
    parser.add_argument("--auth", action="store_true", help="API keys on, as in production")
    args = parser.parse_args()
    with ExitStack() as stack:
        before = stack.enter_context(worktree(args.rev))
        stacks = {
            "before": stack.enter_context(stoker_up({}, args.auth, root=before)),
            "after": stack.enter_context(stoker_up({}, args.auth)),
        }
        kinds = cases_for(stacks["after"])
        cases = {name: kinds[name] for name in (c.strip() for c in args.cases.split(",")) if name}
        for running in stacks.values():  # warm: first-of-a-kind costs (cache fill, imports)
            for send in cases.values():
                Load(send, 5 * args.clients, args.clients, running.headers).run(running.base)
        tallies = {case: {name: Tally() for name in stacks} for case in cases}
        for round_ in range(args.rounds):
            order = list(stacks) if round_ % 2 == 0 else list(reversed(stacks))
            for case, send in cases.items():
                for name in order:
                    tallies[case][name].add(*burst(stacks[name], send, args.jobs, args.clients))
    table = markdown(tallies, args.rev)
    console.print(table, soft_wrap=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    per_job = {case: {name: t.per_job() for name, t in pair.items()} for case, pair in tallies.items()}
    (RESULTS / "costpair.json").write_text(json.dumps({"rev": args.rev, "args": vars(args), "per_job": per_job}))
    (RESULTS / "costpair.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
