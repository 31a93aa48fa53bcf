"""The engine stays readable: no file in rptrain/engine/ over 350 lines, no function over 60."""
from __future__ import annotations

import ast
from pathlib import Path

import rptrain.engine

ENGINE = Path(rptrain.engine.__file__).parent
MAX_FILE_LINES, MAX_FUNCTION_LINES = 350, 60


def test_engine_files_and_functions_are_short():
    long_files, long_functions = [], []
    for path in sorted(ENGINE.glob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long_functions.append(f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long_files, long_files
    assert not long_functions, long_functions
