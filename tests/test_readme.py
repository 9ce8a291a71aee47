"""The README's quickstart is valid Python that uses only the public API (it runs on GPUs in
tests/multigpu/test_readme.py)."""

import ast

import pytest

import cute_ep
from tests.multigpu.test_readme import quickstart

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)


def test_the_quickstart_parses_and_names_only_public_api():
    tree = ast.parse(quickstart())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "cute_ep"}
    assert used and used <= set(cute_ep.__all__), used - set(cute_ep.__all__)
