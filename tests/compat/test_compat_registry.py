"""The compatibility registry is the truth: docs/engine.md's table is generated from it, every
claimed feature is checked by a compat test (or the named test elsewhere), and every feature not
covered is refused as listed (a 400 naming the field, or 404) by `slipstream serve`."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import test_compat_openai  # noqa: F401 - registers its features
import test_compat_sglang  # noqa: F401 - registers its features
from compat_registry import COVERED, DOC, FEATURES, doc_section, render_table

ROOT = Path(__file__).resolve().parents[2]


def test_doc_table_is_generated_from_the_registry():
    assert doc_section(DOC.read_text()) == render_table(), (
        "docs/engine.md's support table is stale: run `python tests/compat/compat_registry.py`"
    )


def test_every_claimed_feature_is_checked():
    for f in FEATURES:
        if f.status != "claimed":
            assert f.refusal is not None, f"{f.key}: not covered, but no refusal to check"
            assert f.key not in COVERED, f"{f.key}: not covered, yet a compat test claims it"
        elif f.elsewhere:
            assert (ROOT / f.elsewhere).is_file(), f"{f.key}: {f.elsewhere} does not exist"
        else:
            assert COVERED.get(f.key), f"{f.key} is claimed but no compat test covers it"


@pytest.mark.parametrize("feature", [f for f in FEATURES if f.refusal], ids=lambda f: f.key)
def test_not_covered_features_are_refused_naming_the_field(served, feature):
    r = feature.refusal
    resp = httpx.post(served.url + r.path, json=r.body, timeout=30)
    assert resp.status_code == r.status, resp.text
    assert r.needle in resp.json()["error"]["message"]
