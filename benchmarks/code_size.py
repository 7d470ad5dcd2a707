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

A second table, for issue 52's measure ("``fz3/step/`` at most 3,200 lines plus what the
any-model and checkpoint issues added there, ... with code and docstrings/comments reported
apart"): each folder's lines as code, docstrings and comments, and blank, told apart by
``tokenize`` and ``ast`` on the file as it is at ``--rev``. A line with any code token is code
(a trailing comment does not make it a comment line); a line inside a string that stands
alone as a statement (a module's, class's or function's docstring, or an attribute's) or
holding only a comment is docstring/comment, blank lines inside a docstring included; a line
with nothing else is blank. The lines issues 50 (any model) and 51 (checkpoints) wrote in
``fz3/step/`` are blamed as above, at ``--base`` (default ``--rev``): the budget is 3,200 plus
them. Count it at the commit issue 52's work starts from: later issue-52 commits that
rewrite those lines take them over and would lower the budget. At ``5aefd37`` (``main`` when
issue 52's items 1-4 began): 50 wrote 156 lines there, 51 wrote 49 (13 of them ``e07e451``, a
fix after a merge to issue 50's ``layer_buffers.py``, which the nearest subject gives to 51;
the sum is the same), so the budget is 3,405 (``--base 5aefd37``).
Code moved out of ``fz3/step/`` still counts (the issue says so); this script cannot see it.
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import os
import re
import subprocess
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCLUDED = {"22", "25", "26", "27", "28", "29", "30"}
TARGETS = {"fz3/step": 1900, "fz3": 7200}  # issue 24's, lines in scope
BUDGET = 3200  # issue 52's for fz3/step/, plus the lines issues 50 and 51 wrote there
BUDGET_ISSUES = ("50", "51")
KINDS = ("code", "docs", "blank")  # docs: docstrings and comments


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


def kinds(source: str) -> list[str]:
    """Each line of ``source``: "code", "docs" (docstring or comment) or "blank"."""
    n = len(source.splitlines())
    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs.update(range(node.lineno, node.end_lineno + 1))
    code: set[int] = set()
    comments: set[int] = set()
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
            tokenize.ENCODING}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in skip:
            lines = range(tok.start[0], tok.end[0] + 1)
            code.update(line for line in lines if line not in docs)
    return ["code" if i in code else "docs" if i in docs or i in comments else "blank"
            for i in range(1, n + 1)]


def blame(rev: str, folder: str, issue_of: dict[str, str]) -> collections.Counter:
    """Lines of ``folder``'s Python files at ``rev``, by (issue, kind of line)."""
    counts: collections.Counter = collections.Counter()
    files = [f for f in git("ls-tree", "-r", "--name-only", rev, folder).split()
             if f.endswith(".py")]
    for path in files:
        kind = kinds(git("show", f"{rev}:{path}"))
        sha, final = None, 0
        for line in git("blame", "-w", "-M", "-C", "-C", "--line-porcelain", rev, "--",
                        path).splitlines():
            header = re.match(r"^([0-9a-f]{40}) \d+ (\d+)", line)
            if header:
                sha, final = header.group(1), int(header.group(2))
            elif line.startswith("\t"):
                counts[issue_of.get(sha, "before"), kind[final - 1]] += 1
    return counts


def by_issue(counts: collections.Counter) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for (issue, _), n in counts.items():
        out[issue] += n
    return out


def split(counts: collections.Counter, issues=None) -> str:
    """``lines | code | docs | blank`` cells of the lines of ``issues`` (all when None)."""
    by_kind = collections.Counter()
    for (issue, kind), n in counts.items():
        if issues is None or issue in issues:
            by_kind[kind] += n
    return " | ".join(str(v) for v in [sum(by_kind.values())] + [by_kind[k] for k in KINDS])


def report_kinds(rev: str, base: str, blamed: dict[str, collections.Counter],
                 issue_of: dict[str, str]) -> None:
    """Issue 52's table: lines by kind per folder, and ``fz3/step/``'s budget."""
    at_base = (blamed["fz3/step"] if base == rev
               else blame(base, "fz3/step", issues_by_commit(base)))
    short = git("rev-parse", "--short", base).strip()
    print("\nIssue 52's measure (docs: docstrings and comments):\n")
    print("| lines | total | code | docs | blank |\n|---|---:|---:|---:|---:|")
    for folder, counts in blamed.items():
        print(f"| `{folder}/` at {rev} | {split(counts)} |")
    for issue in BUDGET_ISSUES:
        print(f"| `fz3/step/` written by issue {issue}, at {base} ({short}) | "
              f"{split(at_base, {issue})} |")
    added = by_issue(at_base)
    extra = sum(added[i] for i in BUDGET_ISSUES)
    total = sum(blamed["fz3/step"].values())
    print(f"\nIssue 52's budget for `fz3/step/`: {BUDGET} + {extra} (issues "
          f"{' and '.join(BUDGET_ISSUES)}) = {BUDGET + extra} lines; at {rev}: {total} "
          f"({total - BUDGET - extra:+d})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--base", default=None,
                    help="where issues 50 and 51's lines in fz3/step/ are counted (default: --rev)")
    args = ap.parse_args()
    rev, base = args.rev, args.base or args.rev
    issue_of = issues_by_commit(rev)
    short = git("rev-parse", "--short", rev).strip()
    print(f"`python benchmarks/code_size.py --rev {rev}` ({short})\n")
    print("| folder | lines | in scope | target | excluded (by issue) |\n|---|---:|---:|---:|---|")
    blamed = {}
    for folder, target in TARGETS.items():
        blamed[folder] = blame(rev, folder, issue_of)
        counts = by_issue(blamed[folder])
        excluded = {k: v for k, v in counts.items() if k in EXCLUDED}
        scope = sum(counts.values()) - sum(excluded.values())
        apart = ", ".join(f"{k}: {v}" for k, v in sorted(excluded.items()))
        print(f"| `{folder}/` | {sum(counts.values())} | {scope} | {target} | {apart} |")
    report_kinds(rev, base, blamed, issue_of)


if __name__ == "__main__":
    main()
