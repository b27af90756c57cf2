"""Tool input schemas that every function-calling API takes unchanged, at the least cost per turn.

The SDK derives each schema from the tool's signature with pydantic; this module tidies the result
once, at registration, instead of anyone writing JSON by hand:

- no `title` anywhere: pydantic's automatic titles repeat the names and cost tokens on every turn;
- `anyOf: [X, {type: null}]` becomes `type: [X, "null"]`, and a `default` null, "", [] or false goes: Gemini drops the
  description of an argument under `anyOf`, while a nullable type keeps it (google-genai reads it as
  `nullable`), and OpenAI's strict mode (which makes every argument required) can still say "none";
- no `additionalProperties` keyword at all: google-genai's MCP conversion fails on any boolean there
  (`'bool' object has no attribute 'items'`, true or false alike), and strict converters
  (openai-agents, Anthropic, langchain) add `false` themselves to an object that has properties.
  Closure is enforced where it counts, on our side: an unknown argument is refused with its name;
- no free-form objects: an object schema without declared properties is a registration error,
  since strict converters either reject it or silently close it to `{}`;
- an object argument (the seed's `args` of pdf_ops and image_ops) is a closed model one level deep,
  written out in place: `$ref` is resolved by some converters and not others, and an object inside it
  would be one more shape for every API to get right. Its closure is ours too (extra='forbid').

`SchemaError` at start-up means a tool signature needs changing, never a client's fault.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.utilities.func_metadata import FuncMetadata
from mcp.types import CallToolResult, TextContent
from pydantic import ValidationError

from coderunner.policy.tool_groups import ToolGroups

NULL = {"type": "null"}


class SchemaError(ValueError):
    """A tool signature produced a schema some function-calling API would reject or degrade."""


def portable_schema(schema: dict[str, Any], tool: str = "tool") -> dict[str, Any]:
    """The tool's input schema as every converter accepts it (see the module doc)."""
    tidy = _tidy(_inlined(schema, tool), tool, root=True)
    tidy.setdefault("properties", {})
    if tidy.get("type") != "object":
        raise SchemaError(f"{tool}: the input schema must be an object")
    return tidy


def _inlined(schema: dict[str, Any], tool: str) -> dict[str, Any]:
    """The schema with each argument that is a model written out in place of its `$ref` (one level:
    a model's own fields are plain values)."""
    definitions = schema.get("$defs", {})
    if any("$ref" in str(definition) or "$defs" in definition for definition in definitions.values()):
        raise SchemaError(f"{tool}: a model inside a model argument; keep argument models one level deep")

    def resolved(node: dict[str, Any], where: str) -> dict[str, Any]:
        reference = node.get("$ref")
        if reference is None:
            variants = node.get("anyOf")
            if variants is None:
                return node
            return {**node, "anyOf": [resolved(variant, where) for variant in variants]}
        name = reference.removeprefix("#/$defs/")
        if name not in definitions:
            raise SchemaError(f"{where}: a $ref this schema does not define ({reference})")
        rest = {key: value for key, value in node.items() if key != "$ref"}
        return {**definitions[name], **rest}

    properties = {name: resolved(sub, f"{tool}.{name}") for name, sub in schema.get("properties", {}).items()}
    inlined = {key: value for key, value in schema.items() if key != "$defs"}
    if "properties" in schema:
        inlined["properties"] = properties
    if "$ref" in str(inlined):
        raise SchemaError(f"{tool}: a $ref where arguments cannot hold one; use flat arguments")
    return inlined


def _tidy(node: dict[str, Any], where: str, root: bool = False) -> dict[str, Any]:
    node = {key: value for key, value in node.items() if key != "title"}
    variants = node.pop("anyOf", None)
    if variants is not None:
        node = _nullable(variants, node, where)
    if "default" in node and _says_nothing(node["default"]):
        del node["default"]
    extra = node.pop("additionalProperties", False)
    if extra is not False:
        raise SchemaError(f"{where}: a free-form object; declare its fields or take a JSON string")
    if node.get("type") == "object" and not node.get("properties") and not root:
        raise SchemaError(f"{where}: an object without declared properties")
    if node.get("type") == "object" and not root:
        node.pop("default", None)  # an object's defaults are its properties' own; the whole one says nothing new
        node.pop("required", None) if not node.get("required") else None
        for name, sub in node.get("properties", {}).items():
            if sub.get("type") == "object" or "object" in sub.get("type", []):
                raise SchemaError(f"{where}.{name}: an object inside an object argument; keep it one level deep")
    if "properties" in node:
        node["properties"] = {name: _tidy(sub, f"{where}.{name}") for name, sub in node["properties"].items()}
    if isinstance(node.get("items"), dict):
        node["items"] = _tidy(node["items"], f"{where}[]")
    return node


def _says_nothing(default: Any) -> bool:
    """A default a model assumes anyway (none, empty, a flag off), which would cost tokens every turn."""
    return default is None or default is False or (isinstance(default, str | list) and not default)


def _nullable(variants: list[Any], rest: dict[str, Any], where: str) -> dict[str, Any]:
    """`anyOf [X, null]` -> X with a nullable type; any other union is refused."""
    others = [variant for variant in variants if variant != NULL]
    if len(variants) != 2 or len(others) != 1 or not isinstance(others[0].get("type"), str):
        raise SchemaError(f"{where}: a union other than 'X or null'; split it into separate arguments")
    other = _tidy(others[0], where)
    return {**other, **rest, "type": [other["type"], "null"]}


def tool_description(text: str | None) -> str:
    """A docstring on one line, without its source indentation and line breaks (both go out on every turn)."""
    return " ".join(inspect.cleandoc(text or "").split("\n"))


def finish_tools(server: MCPServer, enabled: Collection[str], groups: ToolGroups) -> None:
    """Keep only the enabled tools; make each one's schema portable and its arguments closed. A tool
    in none of the declared `groups` is refused: no `tools` setting could ever offer it.

    mcp 2.3 has no public way to edit a registered tool, hence the guarded private access.
    """
    manager = getattr(server, "_tool_manager", None)
    if manager is None:
        raise SchemaError("this mcp version keeps its tools elsewhere; tool schemas cannot be finished")
    for tool in list(manager.list_tools()):
        if tool.name not in groups.of:  # else no `tools` setting could ever offer it: it would vanish unseen
            raise SchemaError(f"{tool.name}: in no tool group; declare one where it is defined: @tools.tool(group=...)")
        if tool.name not in enabled:
            server.remove_tool(tool.name)
            continue
        tool.parameters = portable_schema(tool.parameters, tool.name)
        tool.description = tool_description(tool.description)
        tool.fn_metadata = _plain_arguments(tool.name, tool.fn_metadata, tool.parameters["properties"])


#: Key under which validation hands its failure on to the call (never a real argument name).
_INVALID = "\x00invalid"


class PlainArguments(FuncMetadata):
    """Argument checking whose failures reach the model as one plain sentence, not pydantic's report.

    The SDK reports a ValidationError as its repr-like text (error types, input_value=..., a URL). Here the
    failure is kept from validation to the call, which answers with an isError result naming each argument.
    Unknown arguments are refused by name (the schema leaves additionalProperties out; see the module doc).
    """

    tool_name: str
    argument_names: list[str]
    #: An object argument's own property names (pdf_ops' `args`), for naming what it takes.
    nested_names: dict[str, list[str]] = {}  # noqa: RUF012 - pydantic copies field defaults

    def validate_arguments(self, arguments_to_validate: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().validate_arguments(arguments_to_validate)
        except ValidationError as exc:
            return {_INVALID: self.explain(exc)}

    async def call_fn(
        self,
        fn: Any,
        fn_is_async: bool,
        arguments: dict[str, Any],
        arguments_to_pass_directly: dict[str, Any] | None = None,
    ) -> Any:
        if _INVALID in arguments:
            return CallToolResult(content=[TextContent(type="text", text=arguments[_INVALID])], is_error=True)
        return await super().call_fn(fn, fn_is_async, arguments, arguments_to_pass_directly)

    def explain(self, exc: ValidationError) -> str:
        problems = []
        for error in exc.errors(include_url=False, include_input=False):
            where = ".".join(str(part) for part in error["loc"]) or "arguments"
            if error["type"] == "extra_forbidden":
                inner = self.nested_names.get(str(error["loc"][0])) if len(error["loc"]) == 2 else None
                names = ", ".join(inner or self.argument_names)
                takes = f"{error['loc'][0]} takes: {names}" if inner else f"it takes: {names}"
                problems.append(f"unknown argument {where!r} ({takes})")
            elif error["type"] == "missing":
                problems.append(f"missing argument {where!r}")
            else:  # a validator's own sentence goes without pydantic's "Value error, " label
                problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
        return f"{self.tool_name}: {'; '.join(problems)}"


def _plain_arguments(name: str, metadata: FuncMetadata, properties: dict[str, Any]) -> PlainArguments:
    arg_model = metadata.arg_model
    arg_model.model_config["extra"] = "forbid"  # a misspelt argument is refused, not silently ignored
    arg_model.model_rebuild(force=True)
    return PlainArguments(
        arg_model=arg_model,
        output_schema=metadata.output_schema,
        output_model=metadata.output_model,
        wrap_output=metadata.wrap_output,
        tool_name=name,
        argument_names=list(properties),
        nested_names={key: list(sub["properties"]) for key, sub in properties.items() if "properties" in sub},
    )
