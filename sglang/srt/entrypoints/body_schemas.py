"""Declared shapes of the native routes' JSON bodies: checked before any handler looks at a field.

Each route that takes a body names its model here. `check_body` validates a parsed body against it (types and
ranges; unknown keys are ignored, as upstream does) and raises a ValueError whose message names the field, so a
malformed body becomes a 400 instead of reaching code that assumes the types. The same models document the bodies
in the server's OpenAPI schema (`body_openapi`), which is what the property-based fuzz tests generate requests from.

Range checks that need the server's state (a token id against the vocabulary, a prompt against the context) stay
where that state is, in the tokenizer manager.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

# Token ids and counts are 64-bit at most: larger JSON integers are refused here rather than deep in torch.
Int64 = Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)]
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**63)]
TokenIds = list[TokenId]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class GenerateBody(_Body):
    text: Optional[Union[StrictStr, list[StrictStr]]] = None
    input_ids: Optional[Union[TokenIds, list[TokenIds]]] = None
    input_embeds: Optional[list[Any]] = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[StrictStr, list[StrictStr]]] = None
    return_logprob: Optional[Union[StrictBool, list[StrictBool]]] = None
    logprob_start_len: Optional[Union[Int64, list[Int64]]] = None
    top_logprobs_num: Optional[Union[Int64, list[Int64]]] = None
    token_ids_logprob: Optional[Union[TokenIds, list[TokenIds]]] = None
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    log_metrics: StrictBool = True
    modalities: Optional[list[StrictStr]] = None
    lora_path: Optional[Union[StrictStr, list[Optional[StrictStr]]]] = None
    session_params: Optional[dict[str, Any]] = None
    custom_logit_processor: Optional[Union[StrictStr, list[Optional[StrictStr]]]] = None
    return_hidden_states: Union[StrictBool, list[StrictBool]] = False
    priority: Optional[Int64] = None
    data_parallel_rank: Optional[Int64] = None


class EmbeddingBody(_Body):
    text: Optional[Union[StrictStr, list[StrictStr], list[list[StrictStr]]]] = None
    input_ids: Optional[Union[TokenIds, list[TokenIds]]] = None
    image_data: Any = None
    rid: Optional[Union[StrictStr, list[StrictStr]]] = None
    sampling_params: Any = None


class TokenizeBody(_Body):
    model: Optional[StrictStr] = None
    prompt: Union[StrictStr, list[StrictStr]]
    add_special_tokens: StrictBool = True


class DetokenizeBody(_Body):
    model: Optional[StrictStr] = None
    tokens: Union[TokenIds, list[TokenIds]]
    skip_special_tokens: StrictBool = True


class AbortBody(_Body):
    rid: Optional[StrictStr] = ""
    abort_all: StrictBool = False


class RerankBody(_Body):
    query: StrictStr
    documents: list[StrictStr]
    top_n: Optional[Annotated[StrictInt, Field(gt=0)]] = None


class ParseFunctionCallBody(_Body):
    text: StrictStr
    tools: list[dict[str, Any]]
    tool_call_parser: Optional[StrictStr] = None


class ScoreBody(_Body):
    """Documents /v1/score; its own checks (openai/score.py) give the messages."""

    query: Union[StrictStr, TokenIds]
    items: Union[list[StrictStr], list[TokenIds]]
    label_token_ids: TokenIds
    apply_softmax: StrictBool = False
    item_first: StrictBool = False
    model: Optional[StrictStr] = None


class SeparateReasoningBody(_Body):
    text: StrictStr
    reasoning_parser: Optional[StrictStr] = None


def validation_message(error: ValidationError) -> str:
    """One line per problem, each naming the field: `sampling_params: Input should be a valid dictionary`."""
    parts = []
    for err in error.errors(include_url=False):
        # Union members add their type name to the location; the field path is what a client needs.
        loc = [str(x) for x in err.get("loc", ()) if not _is_union_tag(x)]
        path = ".".join(loc)
        parts.append(f"{path}: {err.get('msg')}" if path else str(err.get("msg")))
    return "; ".join(dict.fromkeys(parts))


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part.startswith(("list[", "dict[", "function-")) or part in {
        "str", "int", "bool", "float", "none", "constrained-int"})


def check_body(model: type[BaseModel], body: Any) -> dict[str, Any]:
    """`body` validated against `model`: the given keys (unknown keys kept), or ValueError naming the field."""
    if not isinstance(body, dict):
        raise ValueError("The request body must be a JSON object.")
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise ValueError(f"Invalid request body: {validation_message(e)}") from None
    return {**body, **parsed.model_dump(exclude_unset=True)}


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema with every `$ref` replaced by its definition (the models are not recursive)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.split("/")[-1]])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


def body_openapi(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body itself: documents the body as `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline_schema(model)}}}}
