"""The shape of a request's tools (OpenAI's function tools), checked the same on both front doors.

A tool is ``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``:
a name of 1-64 letters, digits, ``_`` or ``-`` (OpenAI's), each given once; a description string;
parameters a JSON schema of an object (OpenAI's: a call's arguments are an object), whose
references point into its own ``$defs`` or ``definitions`` (a named or required tool choice
constrains the answer to the schema, placed inside a larger one for ``required``, where only those
references still resolve), nesting at most :data:`MAX_PARAMETERS_DEPTH` levels (so that the
``required`` schema stays within :data:`common.structured_outputs.MAX_SCHEMA_DEPTH`).
"""

from __future__ import annotations

import re

from common.structured_outputs import MAX_SCHEMA_DEPTH, schema_depth

MAX_TOOLS = 128
#: Levels a tool's parameters schema nests at most: ``required`` wraps it 5 levels deep.
MAX_PARAMETERS_DEPTH = MAX_SCHEMA_DEPTH - 5
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_REF_PREFIXES = ("#/$defs/", "#/definitions/")


def check_tools(tools) -> None:
    """Raises ValueError naming ``tools[i]...``: not a list of at most :data:`MAX_TOOLS` function
    tools of the shape in the module docstring."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of tool objects")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}} '
                             "(function tools are served)")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}"[:200])
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        if fn.get("parameters") is not None:
            _check_parameters(fn["parameters"], f"{where}.function.parameters")


def _check_parameters(schema, where: str) -> None:
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ValueError(f"{where} must be the JSON schema of an object (a call's arguments are one)")
    for key in ("$defs", "definitions"):
        if key in schema and not isinstance(schema[key], dict):
            raise ValueError(f"{where}.{key} must be an object")
    if schema_depth(schema) > MAX_PARAMETERS_DEPTH:
        raise ValueError(f"{where} nests deeper than {MAX_PARAMETERS_DEPTH} levels")
    todo = [schema]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if ref is not None and not (isinstance(ref, str) and ref.startswith(_REF_PREFIXES)):
                raise ValueError(f"{where}: $ref {ref!r} is not served: references point into the schema's own "
                                 "$defs or definitions (#/$defs/..., #/definitions/...)"[:300])
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
