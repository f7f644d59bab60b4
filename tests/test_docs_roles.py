"""The API reference shows the docstrings' Sphinx roles as links (``docs/hooks/roles.py``).

The rewrite itself is checked on sample HTML; one strict build of the site (a few seconds)
checks that no raw role is left on the reference pages and that every link lands on an anchor.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAW_ROLE = re.compile(r":(?:py:)?(?:class|meth|mod|func|attr|data|exc|obj|const):")


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("roles_hook", ROOT / "docs/hooks/roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


roles = _hook()

DOCUMENTED = {
    "distamp.DistAMP",
    "distamp.DistAMP.setup",
    "distamp.DistributedGradScaler",
    "distamp.precision.policy.parse_precision",
}
PAGE = (
    '<h2 id="distamp.DistAMP" class="doc doc-heading">DistAMP</h2>'
    "<p>See :meth:<code>setup</code>, :class:<code>~distamp.DistributedGradScaler</code>, "
    ":func:<code>~.precision.policy.parse_precision</code>, :mod:<code>~.parallel.comm_hooks</code>"
    " and :class:<code>the scaler &lt;distamp.DistributedGradScaler&gt;</code>.</p>"
)


def test_roles_become_links_to_the_first_documented_candidate() -> None:
    html, links, plain = roles.rewrite(PAGE, DOCUMENTED.__contains__)
    assert (links, plain) == (4, 1)
    assert not RAW_ROLE.search(html), html
    assert '<autoref identifier="distamp.DistAMP.setup" optional><code>setup</code>' in html
    scaler = '<autoref identifier="distamp.DistributedGradScaler" optional>'
    assert f"{scaler}<code>DistributedGradScaler</code></autoref>" in html  # ~: last part only
    assert f"{scaler}<code>the scaler</code></autoref>" in html  # an explicit title is kept
    assert 'identifier="distamp.precision.policy.parse_precision"' in html  # relative to distamp
    assert "<code>comm_hooks</code> and" in html  # not documented: plain code, no link


def test_candidates_search_the_object_its_parents_then_the_package() -> None:
    assert roles.candidates("state_dict", "distamp.DistAMP.setup") == [
        "distamp.DistAMP.setup.state_dict",
        "distamp.DistAMP.state_dict",
        "distamp.state_dict",
    ]
    assert roles.candidates(".parallel.topology", "") == ["distamp.parallel.topology"]
    assert roles.candidates("distamp.DistAMP", "")[0] == "distamp.DistAMP"


def test_the_built_reference_has_links_not_roles(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs tools come with the dev extra")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    pages = sorted((site / "reference").glob("*/index.html"))
    assert pages
    links = 0
    for page in pages:
        html = page.read_text(encoding="utf-8")
        assert not RAW_ROLE.search(html), f"{page}: a raw role is left"
        for href in re.findall(r'<a class="autorefs autorefs-internal"[^>]*href="([^"]+)"', html):
            path, _, anchor = href.partition("#")
            target = (page.parent / path).resolve() if path else page
            target = target / "index.html" if target.is_dir() else target
            assert f'id="{anchor}"' in target.read_text(encoding="utf-8"), f"{page}: {href}"
            links += 1
    assert links > 50, f"only {links} cross-reference links on the reference pages"
