"""The private torch symbols HiPress needs still exist (``hipress.torch.internals``), and
no other module of the plugins reaches into torch's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", __import__("hipress.torch.internals",
                                            fromlist=["PRIVATE"]).PRIVATE)
def test_each_private_torch_symbol_hipress_needs_is_still_there(path):
    from hipress.torch.internals import resolve

    assert resolve(path) is not None, path


def test_fsdp2s_interfaces_are_what_fsdp_takes():
    import inspect

    from torch.distributed.fsdp import FSDPModule

    from hipress.torch.internals import AllGather, ReduceScatter

    assert inspect.isabstract(ReduceScatter) and inspect.isabstract(AllGather)
    for setter in ("set_custom_reduce_scatter", "set_custom_all_gather",
                   "set_all_reduce_hook"):
        assert callable(getattr(FSDPModule, setter)), setter


def test_no_other_module_uses_a_private_torch_name():
    """A private name of torch (``._x`` on a torch object, or a ``torch.*._x`` import)
    appears only in the adapter."""
    found = []
    for path in sorted((ROOT / "plugins").rglob("*.py")):
        if path.name == "internals.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("torch") and \
                    any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{path.name}:{node.lineno}: from {node.module}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                    not node.attr.startswith("__") and "torch" in ast.unparse(node.value):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
