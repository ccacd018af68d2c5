"""The README's Python snippet (serve a checkpoint, call it with the OpenAI SDK) runs as written
against a served model (issue 49): only the address and the model name are the test server's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_openai_clients import NAME, model, served  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
openai = pytest.importorskip("openai")


def test_the_readme_openai_snippet_runs(served, capsys) -> None:  # noqa: F811
    server, client, _engine = served
    (snippet,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert "http://127.0.0.1:30000/v1" in snippet and 'model="quickstart"' in snippet
    code = snippet.replace("http://127.0.0.1:30000", server.url).replace('"quickstart"', repr(NAME))
    exec(compile(code, "README.md", "exec"), {})
    want = client.completions.create(model=NAME, prompt="12+34=", max_tokens=8, temperature=0)
    assert capsys.readouterr().out == want.choices[0].text + "\n"  # greedy: the same text
    recipes = (ROOT / "docs/recipes.md").read_text()
    assert snippet in recipes, "docs/recipes.md shows another snippet than the README"
