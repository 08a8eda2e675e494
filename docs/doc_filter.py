#!/usr/bin/env python3
"""Doxygen input filter for the Markdown pages: the site builds with any subset of the steps.

    python3 docs/doc_filter.py --root SOURCE_DIR PAGE.md     # the filtered page on stdout

A course pack (common/scripts/lab.py pack) stops before a chosen step: the later step folders
and their lab handouts are not there, yet the top-level README, docs/algorithm.md,
docs/labs.md and the step READMEs link to them. Doxygen runs every Markdown page through this
filter (FILTER_PATTERNS in docs/Doxyfile.in), and lab.py applies the same function when it
writes a pack, so the pages a student reads hold no dead link either. In a tree with every
step present, nothing changes.

The rules, outside fenced code blocks:
- a table row whose first cell names or links a step folder that is not in the tree, or links
  a page or file that is not there, is dropped (a results row, a row of the step table);
- any other link to a file that is not there keeps its text and loses the link;
- `@ref stepNN` / `@ref lab_NN` to a step or handout that is not there becomes plain text.

Python 3 standard library only.
"""

import re
import sys
from pathlib import Path

# A step folder's name: two digits, an underscore, a lower-case word ("05_split_q").
STEP_RE = re.compile(r"(?<![\w/])([01]\d_[a-z][a-z0-9_]*)")
# [text](target) and ![alt](target); the target has no spaces.
LINK_RE = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
# @ref / \ref to a step page (stepNN) or a lab handout (lab_NN).
REF_RE = re.compile(r"[@\\]ref\s+(step(\d\d)|lab_(\d\d))\b")
FENCE_RE = re.compile(r"^\s*(```|~~~)")


class Tree:
    """What exists in the source tree, for the questions the rules ask."""

    def __init__(self, root):
        self.root = Path(root).resolve()

    def step_folder(self, number):
        """The folder NN_* of a step number, or None."""
        for d in sorted(self.root.glob(f"{number}_*")):
            if (d / "README.md").exists() or (d / "kernel.cu").exists():
                return d
        return None

    def ref_missing(self, ref_id, step_number, lab_number):
        if step_number is not None:
            return self.step_folder(step_number) is None
        return not (self.root / "docs" / f"lab_{lab_number}.md").exists()

    def link_missing(self, target, page_dir):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return False  # a URL, mailto:, or an anchor on the same page
        path = target.split("#", 1)[0]
        if not path:
            return False
        return not (page_dir / path).exists()

    def step_missing(self, name):
        """True if `name` looks like a step folder of this project and is not in the tree."""
        return not (self.root / name).is_dir()


def refs_to_missing(text, tree, page_dir):
    """True if `text` links or refers to something that is not in the tree."""
    for m in LINK_RE.finditer(text):
        if tree.link_missing(m.group(3), page_dir):
            return True
    for m in REF_RE.finditer(text):
        if tree.ref_missing(m.group(1), m.group(2), m.group(3)):
            return True
    return False


def unlink(line, tree, page_dir):
    """`line` with the links and refs to missing things turned into plain text."""

    def link(m):
        bang, text, target = m.groups()
        if not tree.link_missing(target, page_dir):
            return m.group(0)
        return "" if bang else text

    def ref(m):
        if not tree.ref_missing(m.group(1), m.group(2), m.group(3)):
            return m.group(0)
        return f"step {m.group(2)}" if m.group(2) else f"lab {m.group(3)}"

    return REF_RE.sub(ref, LINK_RE.sub(link, line))


def first_cell(line):
    cells = line.strip().split("|")
    return cells[1] if len(cells) > 2 else ""


def filter_markdown(text, page, root):
    """The page `page` (a path inside `root`) with the rules of this module applied."""
    tree = Tree(root)
    page_dir = Path(page).resolve().parent
    out = []
    in_fence = False
    for line in text.splitlines(keepends=True):
        if FENCE_RE.match(line):
            in_fence = not in_fence
            out.append(line)
            continue
        if in_fence:
            out.append(line)
            continue
        if line.lstrip().startswith("|") and not re.match(r"^\s*\|[\s:|-]*$", line):
            cell = first_cell(line)
            names = [m.group(1) for m in STEP_RE.finditer(cell)]
            if refs_to_missing(cell, tree, page_dir) or any(tree.step_missing(n) for n in names):
                continue
        out.append(unlink(line, tree, page_dir))
    return "".join(out)


def main(argv):
    args = list(argv)
    root = Path.cwd()
    if len(args) >= 2 and args[0] == "--root":
        root = Path(args[1])
        args = args[2:]
    if len(args) != 1:
        print("usage: doc_filter.py [--root SOURCE_DIR] PAGE.md", file=sys.stderr)
        return 2
    page = Path(args[0])
    text = page.read_text(encoding="utf-8")
    sys.stdout.write(filter_markdown(text, page, root))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
