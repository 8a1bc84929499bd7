"""The wire contract (package kvcdn-wire) holds: the server answers only ErrorCode codes, names every
one of them, and docs/hosted-api.md lists exactly those; importing it costs the client no pydantic.

The server's codes are read from its source (AST), so a refusal added with a string code fails here
before any request is made.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from kvcdn_wire import ErrorCode

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "plugins" / "kvcdn-server" / "kvcdn_server"
CODES = {code.value for code in ErrorCode}


def string_codes(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, code)`` for each string constant that spells an error code, other than a dict key
    (``{"timeout": 60}`` configures a driver; ``{404: "not_found"}`` maps to a code)."""
    keys = {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys if k is not None}
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in CODES and id(node) not in keys
    ]


def untyped_api_errors(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, source)`` for each ``ApiError(status, code, ...)`` whose code is not an
    ``ErrorCode.MEMBER`` (or a name passed through, such as a helper's parameter)."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ApiError":
            code = node.args[1] if len(node.args) > 1 else next(k.value for k in node.keywords if k.arg == "code")
            typed = isinstance(code, ast.Attribute) and getattr(code.value, "id", None) == "ErrorCode"
            if not (typed or isinstance(code, ast.Name)):
                bad.append((node.lineno, ast.unparse(code)))
    return bad


def members_named(tree: ast.AST) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ErrorCode"
    }


def server_trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(SERVER.rglob("*.py"))}


def test_the_server_answers_no_string_code():
    found = [f"{name}:{line} {code!r}" for name, tree in server_trees().items() for line, code in string_codes(tree)]
    found += [f"{name}:{line} {src}" for name, tree in server_trees().items() for line, src in untyped_api_errors(tree)]
    assert found == []


def test_the_scan_finds_a_string_code():
    tree = ast.parse(
        "raise ApiError(409, 'conflict', 'x')\n"
        "raise ApiError(404, code=f'not_{x}', message='y')\n"
        "raise _Refused(422, 'size_mismatch', 'z')\n"
        "body = {'error': 'internal_error'}\n"
        "codes = {405: 'method_not_allowed'}\n"
        "options = {'timeout': 60}\n"
        "raise ApiError(410, ErrorCode.UPLOAD_EXPIRED, 'w')\n"
    )
    assert string_codes(tree) == [
        (1, "conflict"),
        (3, "size_mismatch"),
        (4, "internal_error"),
        (5, "method_not_allowed"),
    ]
    assert untyped_api_errors(tree) == [(1, "'conflict'"), (2, "f'not_{x}'")]


def test_the_enum_is_every_code_the_server_names():
    named = set().union(*(members_named(tree) for tree in server_trees().values()))
    assert named == set(ErrorCode.__members__)


def documented_codes(text: str) -> set[str]:
    """The codes of the 'Error codes' table of docs/hosted-api.md (a row may name several)."""
    section = text.split("### Error codes", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| ")]
    rows = [row for row in rows if re.fullmatch(r"\d(\d\d|xx)", row[1].strip())]  # not the header
    return {code for row in rows for code in re.findall(r"`([a-z0-9_]+)`", row[2])}


def test_the_docs_list_every_code_and_no_other():
    documented = documented_codes((ROOT / "docs" / "hosted-api.md").read_text(encoding="utf-8"))
    assert sorted(documented - CODES) == [] and sorted(CODES - documented) == []


def test_the_docs_check_reads_the_table():
    text = "### Error codes\n\n| status | `error` | when |\n|---|---|---|\n| 413 | `a_b` / `c` | `not_this` |\n| 4xx | `e` | y |\n\n## Next\n| 1 | `d` | x |\n"
    assert documented_codes(text) == {"a_b", "c", "e"}


def test_a_code_is_its_string():
    assert ErrorCode.NOT_FOUND == "not_found" and str(ErrorCode.NOT_FOUND) == "not_found"
    assert "already_confirmed" in __import__("kvcdn_wire").CONFIRM_MAYBE_DONE


def test_importing_the_package_loads_no_pydantic():
    code = "import sys, kvcdn_wire; kvcdn_wire.path(kvcdn_wire.ARTIFACT, artifact_id='x'); print('pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_infer_composition_names_the_cores_rules():
    """The wire cannot import core: its ``select`` choices are kept core's by this test."""
    import typing

    from kvcdn_core.model.defaults import COMPOSE_RULES
    from kvcdn_wire.requests import InferRequest

    choices = typing.get_args(typing.get_args(InferRequest.model_fields["select"].annotation)[0])
    assert choices == COMPOSE_RULES
