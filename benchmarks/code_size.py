"""Lines of ``fz3/`` and ``fz3/step/`` by the issue that wrote them: issue 24's size target
measured the way it asks ("over the features that exist today ... lines added by the
checkpoint, misuse, HF and selective-recompute issues are excluded and reported apart").

    python benchmarks/code_size.py        # ~10 s; needs the git history (a clone, not an archive)

Each line of each ``.py`` file is blamed to the commit that last wrote it, following lines
moved or copied between files and ignoring whitespace (``git blame -w -M -C -C``), and the
commit to an issue: the one its subject names ("Issue 26", "(issue 28, item 5)"), else the
one the nearest earlier commit's subject names (review mends follow their issue); lines from
before any such subject count as "before". Excluded from the target's count are the issues
that did not exist when issue 24 was filed and those it names: checkpoints (22), selective
recompute (25), host cost (26), mixture-of-experts (27), misuse (28), what a user reads (29)
and Hugging Face models (30).

What this cannot see: a later issue that rewrote an older feature's lines takes them over,
and an older line a later issue made longer stays the older one's. The in-scope count is
the lines that no later issue touched, so it errs low where later issues rewrote old code.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCLUDED = {"22", "25", "26", "27", "28", "29", "30"}
TARGETS = {"fz3/step": 1900, "fz3": 7200}  # issue 24's, lines in scope


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def issues_by_commit(rev: str) -> dict[str, str]:
    """Each commit up to ``rev`` -> the issue its subject, or the nearest earlier one, names."""
    out, current = {}, "before"
    for line in git("log", "--reverse", "--format=%H %s", rev).splitlines():
        sha, subject = line.split(" ", 1)
        named = re.search(r"\b[Ii]ssue (\d+)", subject)
        if named:
            current = named.group(1)
        out[sha] = current
    return out


def blame(rev: str, folder: str, issue_of: dict[str, str]) -> collections.Counter:
    """Lines of ``folder``'s Python files at ``rev``, by issue."""
    counts: collections.Counter = collections.Counter()
    files = [f for f in git("ls-tree", "-r", "--name-only", rev, folder).split()
             if f.endswith(".py")]
    for path in files:
        sha = None
        for line in git("blame", "-w", "-M", "-C", "-C", "--line-porcelain", rev, "--",
                        path).splitlines():
            header = re.match(r"^([0-9a-f]{40}) \d+ \d+", line)
            if header:
                sha = header.group(1)
            elif line.startswith("\t"):
                counts[issue_of.get(sha, "before")] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD")
    rev = ap.parse_args().rev
    issue_of = issues_by_commit(rev)
    print(f"`python benchmarks/code_size.py --rev {rev}` ({git('rev-parse', '--short', rev).strip()})\n")
    print("| folder | lines | in scope | target | excluded (by issue) |\n|---|---:|---:|---:|---|")
    for folder, target in TARGETS.items():
        counts = blame(rev, folder, issue_of)
        excluded = {k: v for k, v in counts.items() if k in EXCLUDED}
        scope = sum(counts.values()) - sum(excluded.values())
        apart = ", ".join(f"{k}: {v}" for k, v in sorted(excluded.items()))
        print(f"| `{folder}/` | {sum(counts.values())} | {scope} | {target} | {apart} |")


if __name__ == "__main__":
    main()
