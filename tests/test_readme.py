"""Every Python snippet of the README runs, in order, in one namespace (as a reader would paste them)."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_snippets_run() -> None:
    snippets = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(snippets) >= 4
    namespace: dict = {}
    for snippet in snippets:
        exec(compile(snippet, str(README), "exec"), namespace)
    assert type(namespace["trainer"].strategy).__name__ == "StaticGraphDDP"
