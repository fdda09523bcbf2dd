"""Print the hook reference of docs/plugins.md from the hook specs' docstrings.

    python scripts/plugin_docs.py > /tmp/ref.md     # tests/test_docs.py checks the doc is current
    python scripts/plugin_docs.py --write           # rewrite the reference section in place
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from prime_core import hookspecs

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
BEGIN, END = "<!-- hook reference: begin -->", "<!-- hook reference: end -->"


def reference() -> str:
    out = []
    for name, fn in vars(hookspecs).items():
        if not name.startswith("prime_") or not callable(fn):
            continue
        sig = str(inspect.signature(fn)).replace("'", "")
        opts = getattr(fn, "prime_spec", {}) or {}
        kind = " (first result wins)" if opts.get("firstresult") else ""
        doc = inspect.getdoc(fn) or ""
        body = doc.replace("Example::\n\n", "Example:\n\n```python\n")
        if "```python" in body:
            head, code = body.split("```python\n", 1)
            code = "\n".join(line[4:] if line.startswith("    ") else line for line in code.splitlines())
            body = f"{head}```python\n{code.strip()}\n```"
        out.append(f"### `{name}{sig}`{kind}\n\n{body}\n")
    return "\n".join(out)


def current() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


if __name__ == "__main__":
    if "--write" in sys.argv:
        text = DOC.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        DOC.write_text(text[:start] + "\n\n" + reference() + "\n" + text[end:])
    else:
        print(reference())
